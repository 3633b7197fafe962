"""Sharded (FSDP2) training with fastai: one file per rank and a manifest, exact resume at the same world
size, another world size continued from the saved shards, DCP as import and export.

The multi-process tests (marked slow) train tests/trainer.py's BatchNorm model (37 rows: uneven shards on 2
and 4 ranks; per-rank BatchNorm statistics) with real `fully_shard` on 2 and 4 CPU processes (gloo), launched
by torchrun as a user launches them, inside `fastai_resume.fsdp_ctx`. Every rank draws its own dropout masks
and augmentation noise, so each rank's own state matters; every comparison is made on every rank. The other
tests build a 2-rank sharded checkpoint by hand, as docs/FORMAT.md describes one, and run in-process."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from procs import ENV, FORKS, HERE, equal, kill_job, shared_run, start, torchrun_trainer, trainer_cmd, wait_for_line
from s3server import Proxy, Server
from torch import nn

import fastai_resume as fr
from fastai_resume import io, objstore, session, shardfiles, stored
from fastai_resume.__main__ import main as cli

BS = 32
KEYS = ("model", "opt", "full_model", "full_opt", "losses", "lrs", "values")
N_ITER = {2: 23, 4: 11}  # training batches per rank and epoch (1500 digits, bs 32, drop_last)
PARAMS = ("0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias")
BUFFERS = ("1.running_mean", "1.running_var", "1.num_batches_tracked")


# ---- a 2-rank sharded checkpoint, built by hand as docs/FORMAT.md says ------------------------------


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


def _parts(t, world):
    "FSDP2's Shard(0): torch.chunk's pieces (rows ceil(n / world) each, the last ones shorter or empty)."
    step = -(-t.shape[0] // world)
    return [(min(r * step, t.shape[0]), t[r * step : (r + 1) * step].clone()) for r in range(world)]


def build_sharded(folder, world=2, token=0x1234ABCD):
    """A sharded checkpoint of `_model()` with an Adam-like optimizer state (one state dict per parameter, as
    fastai's Optimizer keeps it), no training position; returns the full model and optimizer state it holds
    (rank 0's BatchNorm statistics; rank 1's are made different)."""
    model = _model()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    opt = [{"grad_avg": torch.randn_like(sd[n]), "step": 3} for n in names]
    os.makedirs(folder, exist_ok=True)
    sizes = []
    for r in range(world):
        entries, msd, ost = [], {}, []
        for k, v in sd.items():
            if k in names:
                off, part = _parts(v, world)[r]
                msd[k] = part
                entries.append(
                    {
                        "path": ["model", k],
                        "shape": list(v.shape),
                        "offset": [off] + [0] * (v.dim() - 1),
                        "placements": [["shard", 0]],
                        "mesh": [world],
                    }
                )
            else:
                msd[k] = v + r if v.is_floating_point() else v  # per-rank buffers differ
        for i, st in enumerate(opt):
            off, part = _parts(st["grad_avg"], world)[r]
            ost.append({"grad_avg": part, "step": 3})
            entries.append(
                {
                    "path": ["opt", "state", i, "grad_avg"],
                    "shape": list(st["grad_avg"].shape),
                    "offset": [off] + [0] * (st["grad_avg"].dim() - 1),
                    "placements": [["shard", 0]],
                    "mesh": [world],
                }
            )
        tree = {
            "fastai_resume": 3,
            "model": msd,
            "opt": {"state": ost, "hypers": [{"lr": 0.1, "mom": 0.9, "sqr_mom": 0.99, "eps": 1e-5, "wd": 0.0}]},
            "train": None,
            "shard": {"rank": r, "world_size": world, "token": token, "dtensors": entries},
        }
        sizes.append(io.save(tree, os.path.join(folder, shardfiles.shard_name(r, world, token))))
    manifest = {
        "fastai_resume_sharded": 1,
        "kind": "model",
        "token": token,
        "world_size": world,
        "shards": [{"rank": r, "file": shardfiles.shard_name(r, world, token), "size": sizes[r]} for r in range(world)],
        "position": None,
    }
    io.save(manifest, os.path.join(folder, "manifest.frk"))
    return sd, opt


def _learner(path):
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner

    xs, ys = torch.randn(64, 5), torch.randint(0, 3, (64,))
    from fastai.data.load import DataLoader

    dls = DataLoaders(DataLoader(list(zip(xs, ys)), bs=8), DataLoader(list(zip(xs, ys)), bs=8), device="cpu")
    return Learner(dls, _model(), loss_func=nn.CrossEntropyLoss(), path=path)


@pytest.fixture
def ckpt(tmp_path):
    folder = tmp_path / "models" / "two.frk"
    sd, opt = build_sharded(folder)
    return folder, sd, opt


def test_a_sharded_checkpoint_loads_into_a_model_that_is_not_sharded_whole(ckpt, tmp_path):
    folder, sd, opt = ckpt
    learn = _learner(tmp_path)
    learn.load("two")
    got = learn.model.state_dict()
    for k in PARAMS_SMALL:
        assert torch.equal(got[k], sd[k]), k  # rebuilt from both ranks' chunks (7 rows: 4 + 3; 3 rows: 2 + 1)
    assert torch.equal(got["1.running_mean"], sd["1.running_mean"])  # rank 0's own statistics
    state = learn.opt.state_dict()["state"]
    assert all(torch.equal(s["grad_avg"], o["grad_avg"]) and s["step"] == 3 for s, o in zip(state, opt))


PARAMS_SMALL = ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")


def test_verify_and_inspect_read_every_shard_and_the_manifest(ckpt, capsys):
    folder, _, _ = ckpt
    assert cli(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"OK +.*two\.frk .*2 ranks", out), out
    assert out.count("shard-0000") == 2 and "manifest.frk" in out
    assert cli(["verify", str(folder.parent)]) == 0  # a models folder: the checkpoint is one entry, not 3 files
    assert "1 ok, 0 bad" in capsys.readouterr().out
    assert cli(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "sharded checkpoint of 2 ranks" in out and "all checksums verify" in out
    # who wrote what: each rank's chunk of each tensor, its offset in the global shape
    assert re.search(r"model\.0\.weight +\[7, 5\] +rank 0: \[0:4\] +rank 1: \[4:7\]", out), out


def test_a_missing_shard_invalidates_the_whole_checkpoint(ckpt, tmp_path, capsys):
    folder, _, _ = ckpt
    (folder / shardfiles.shard_name(1, 2, 0x1234ABCD)).unlink()
    assert cli(["verify", str(folder)]) == 1
    assert "BAD" in capsys.readouterr().out
    assert "rank 1's file" in shardfiles.problem(folder)
    learn = _learner(tmp_path)
    with pytest.raises(fr.CheckpointError, match="rank 1's file .* is missing"):
        learn.load("two")
    # negative control: rank 0's file alone is complete and verifies: only the manifest's rule refuses it
    fr.info(folder / shardfiles.shard_name(0, 2, 0x1234ABCD), verify=True)


def test_a_corrupt_shard_is_found_by_verify_and_refused_by_load(ckpt, tmp_path, capsys):
    folder, _, _ = ckpt
    f = folder / shardfiles.shard_name(1, 2, 0x1234ABCD)
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF  # in the first blob
    f.write_bytes(bytes(b))
    assert cli(["verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "rank 1" in out, out
    learn = _learner(tmp_path)
    with pytest.raises(fr.CheckpointError, match="checksum|CRC"):
        learn.load("two")


def test_a_folder_without_its_manifest_is_no_checkpoint(ckpt, tmp_path):
    folder, _, _ = ckpt
    (folder / "manifest.frk").unlink()  # what a save killed before its manifest leaves
    assert not stored.exists(folder)
    with pytest.raises(fr.CheckpointError, match="no manifest.frk"):
        shardfiles.verify(folder)
    with pytest.raises(fr.CheckpointError, match="did not finish"):
        _learner(tmp_path).load("two")


def _rewrite_shards(folder, change):
    "Apply `change(tree)` to every rank's file of the hand-built checkpoint, the manifest's sizes kept right."
    m = fr.load(folder / "manifest.frk")
    for s in m["shards"]:
        tree = fr.load(folder / s["file"])
        change(tree)
        s["size"] = fr.save(tree, folder / s["file"])
    fr.save(m, folder / "manifest.frk")


def test_a_sharded_tensor_of_another_shape_is_refused_before_anything_is_allocated(ckpt, tmp_path, capsys):
    folder, _, _ = ckpt
    _rewrite_shards(folder, lambda t: t["shard"]["dtensors"][0].update(shape=[7_000_000_000, 5]))
    with pytest.raises(fr.CheckpointError, match=r"shape \(7000000000, 5\) in the file, \(7, 5\) in this model"):
        _learner(tmp_path).load("two")
    assert cli(["convert", str(folder), str(tmp_path / "out.pth")]) == 2  # no model to compare with: the data
    assert "the saved chunks hold 35 elements" in capsys.readouterr().err  # bounds what is made


@pytest.mark.parametrize(
    "change,error",
    [
        (lambda m: m["shards"].pop(), "shards: expected a list of 2"),
        (lambda m: m.update(token=5), "shards\\[0\\]"),
        (lambda m: m.update(fastai_resume_sharded=99), "newer fastai_resume"),
    ],
    ids=["a-shard-fewer", "another-save", "newer-schema"],
)
def test_a_malformed_manifest_is_refused_with_what_is_wrong(ckpt, change, error):
    folder, _, _ = ckpt
    m = fr.load(folder / "manifest.frk")
    change(m)
    fr.save(m, folder / "manifest.frk")
    with pytest.raises(fr.CheckpointError, match=error):
        shardfiles.read_manifest(folder)


def test_a_chunk_outside_its_tensor_is_refused(ckpt, tmp_path):
    folder, _, _ = ckpt
    f = folder / shardfiles.shard_name(1, 2, 0x1234ABCD)
    tree = fr.load(f)
    tree["shard"]["dtensors"][0]["offset"] = [6, 0]  # 3 rows at row 6 of 7
    size = fr.save(tree, f)
    m = fr.load(folder / "manifest.frk")
    m["shards"][1]["size"] = size
    fr.save(m, folder / "manifest.frk")
    with pytest.raises(fr.CheckpointError, match="outside"):
        _learner(tmp_path).load("two")


def test_dcp_export_then_import_round_trips_the_model_and_optimizer(ckpt, tmp_path, capsys):
    folder, sd, opt = ckpt
    dcp_dir = tmp_path / "dcp"
    assert cli(["convert", str(folder), str(dcp_dir), "--to", "dcp"]) == 0
    assert (dcp_dir / ".metadata").is_file()
    # torch's own reader sees the whole tensors
    import torch.distributed.checkpoint as dcp

    want = {"model": {k: torch.empty_like(v) for k, v in sd.items()}}
    dcp.load(want, storage_reader=dcp.FileSystemReader(str(dcp_dir)), no_dist=True)
    assert all(torch.equal(want["model"][k], sd[k]) for k in sd)
    back = tmp_path / "back.frk"
    assert cli(["convert", str(dcp_dir), str(back)]) == 0
    tree = fr.load(back)
    assert equal(tree["model"], sd)
    assert all(torch.equal(s["grad_avg"], o["grad_avg"]) for s, o in zip(tree["opt"]["state"], opt))
    assert "wrote" in capsys.readouterr().out


def test_continuing_at_another_world_size_counts_the_position_in_samples():
    class Dls:
        train = None

    class Learn:
        dls = Dls()

    pos = {"epoch": 1, "iter": 10, "n_iter": 23, "n_epoch": 3, "bs": 32, "world_size": 2, "n_iter_all": 46}
    train = {"position": pos, "grads": None, "ranks": None}
    with pytest.warns(UserWarning, match="no longer the uninterrupted run's"):
        moved = session.continue_at(Learn(), train, "ckpt", 3)["position"]  # (world size 1 here)
    assert (moved["epoch"], moved["iter"], moved["n_iter"], moved["world_size"]) == (1, 20, 46, 1)
    assert moved["train_iter"] == 46 + 20 and moved["pct_train"] == 66 / 138
    with pytest.raises(ValueError, match="gradient accumulation"):
        session.continue_at(Learn(), {**train, "grads": [torch.zeros(1)]}, "ckpt", 3)


# ---- real fully_shard on 2 and 4 processes -----------------------------------------------------------


def torchrun(n, path, out, *args):
    return torchrun_trainer(n, path, out, "--fsdp", "--bn", *args)


def launch(n, path, out, *args, ok=True):
    p = subprocess.run(torchrun(n, path, out, *args), capture_output=True, text=True, env=ENV, timeout=900)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def ranks(out, n):
    return [fr.load(f"{out}.rank{r}") for r in range(n)]


def _name(prefix, args):
    return prefix + "".join(a.strip("-").replace(",", "_") for a in args)


@functools.cache
def reference(tmp_root, n, *args):
    "The uninterrupted n-process run (one result per rank), made once per session."
    outs = tuple(f"out.frk.rank{r}" for r in range(n))
    return shared_run(
        tmp_root, _name(f"fsdp{n}-ref", args), lambda d: launch(n, d, os.path.join(d, "out.frk"), *args), outs
    )


@functools.cache
def killed(tmp_root, n, epoch, k, *args):
    """The folder of an n-process run that saved `crash` at (epoch, k), wrote the state it saved (gathered, from
    the live learner: `dead.frk.rank{r}.saved`) and was then killed by SIGKILL on every rank."""

    def make(d):
        p = launch(n, d, os.path.join(d, "dead.frk"), "--die-at", f"{epoch},{k}", "--dump-state", *args, ok=False)
        assert p.returncode != 0 and "SIGKILL" in p.stdout + p.stderr
        fr.save({"returncode": p.returncode}, os.path.join(d, "killed.frk"))  # last: the run is complete

    name = _name(f"fsdp{n}-killed-{epoch}-{k}", args)
    shared_run(tmp_root, name, make, ("killed.frk",))
    return os.path.join(tmp_root, name)


def from_killed(tmp_root, tmp_path, n, epoch, k, *args):
    "The sharded checkpoint a killed run saved, copied into this test's models folder."
    (tmp_path / "models").mkdir(exist_ok=True)
    src = os.path.join(killed(tmp_root, n, epoch, k, *args), "models", "crash.frk")
    shutil.copytree(src, tmp_path / "models" / "crash.frk")
    return tmp_path / "models" / "crash.frk"


def assert_same_on_every_rank(ref, res, n):
    for r, (a, b) in enumerate(zip(ref, res)):
        assert len(b["losses"]) == 3 * N_ITER[n]
        for key in KEYS:
            assert equal(a[key], b[key]), f"rank {r}: {key} differs from the uninterrupted run"


def _local_rows(n):
    "The rows of the 37-row weight each of n ranks holds (FSDP2 shards dim 0 as torch.chunk does)."
    step = -(-37 // n)
    return [max(0, min(37, (r + 1) * step) - r * step) for r in range(n)]


@pytest.mark.slow
def test_the_reference_run_shards_unevenly_keeps_per_rank_batchnorm_and_splits_the_data(tmp_root):
    ref = reference(tmp_root, 2)
    assert [r["model"]["0.weight"].shape[0] for r in ref] == _local_rows(2) == [19, 18]
    assert not equal(ref[0]["model"]["1.running_mean"], ref[1]["model"]["1.running_mean"])  # per-rank statistics
    assert equal(ref[0]["full_model"]["0.weight"], ref[1]["full_model"]["0.weight"])
    assert ref[0]["losses"] == ref[1]["losses"]  # fastai gathers the loss over the ranks
    for e in ("0", "1", "2"):
        both = torch.cat([ref[0]["seen"][e], ref[1]["seen"][e]])
        assert sorted(both.tolist()) == list(range(1500))  # each item once per epoch, across the ranks


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,epoch,k,args",
    [(2, 1, 10, ()), (2, 2, 5, ("--torch-opt",)), (4, 1, 5, ())],
    ids=["2-ranks-fastai-adam", "2-ranks-optimwrapper-adamw", "4-ranks-fastai-adam"],
)
def test_kill_every_rank_mid_epoch_then_load_resumes_bitwise_on_every_rank(tmp_root, tmp_path, n, epoch, k, args):
    ref = reference(tmp_root, n, *args)
    folder = from_killed(tmp_root, tmp_path, n, epoch, k, *args)
    m = shardfiles.read_manifest(folder)
    assert m["world_size"] == n and (m["position"]["epoch"], m["position"]["iter"]) == (epoch, k)
    rows = [fr.load(folder / s["file"])["model"]["0.weight"].shape[0] for s in m["shards"]]
    assert rows == _local_rows(n)  # each rank wrote its own rows: no file holds the gathered weight
    p = launch(n, tmp_path, tmp_path / "res.frk", "--resume", "crash", *args)
    assert p.stdout.count(f"at epoch {epoch}, iteration {k}/{N_ITER[n] + (n == 4)}") == n
    res = ranks(tmp_path / "res.frk", n)
    assert_same_on_every_rank(ref, res, n)
    for r in range(n):  # each rank skipped its own share and loaded the rest of it, nothing else
        assert equal(res[r]["seen"][str(epoch)], ref[r]["seen"][str(epoch)][k * BS :])


@pytest.mark.slow
@pytest.mark.parametrize("control", ["--shared-buffers", "--shared-rng"])
def test_negative_control_rank0s_batchnorm_statistics_or_rng_on_every_rank_break_equality(tmp_root, tmp_path, control):
    "What a plain learn.load did before: rank 1 took rank 0's state. The run then differs on rank 1."
    ref = reference(tmp_root, 2)
    from_killed(tmp_root, tmp_path, 2, 1, 10)
    launch(2, tmp_path, tmp_path / "res.frk", "--resume", "crash", control)
    res = ranks(tmp_path / "res.frk", 2)
    assert res[0]["losses"][: N_ITER[2] + 10] == ref[0]["losses"][: N_ITER[2] + 10]  # the restored history
    assert not equal(ref[1]["full_model"], res[1]["full_model"])


def _autocheckpointed_job(tmp_path, args, kills=("[0, ", "[1, "), seed=0.2):
    "Launch, kill every rank (SIGKILL) mid-epoch after each of `kills`' lines, then run to the end."
    for row in kills:
        p = start(torchrun(2, tmp_path, tmp_path / "out.frk", *args))
        wait_for_line(p, row)
        time.sleep(seed)
        kill_job(p)
    return launch(2, tmp_path, tmp_path / "out.frk", *args)


@pytest.mark.slow
def test_autocheckpoint_sigkill_of_every_rank_then_autoresume_is_bitwise_equal(tmp_root, tmp_path):
    ref = reference(tmp_root, 2)
    p = _autocheckpointed_job(tmp_path, ("--auto", "4", "--slow-ms", "40"))
    assert "AutoCheckpoint: found" in p.stdout
    assert_same_on_every_rank(ref, ranks(tmp_path / "out.frk", 2), 2)
    models = tmp_path / "models"
    kept = [c for c in models.glob("auto-*.frk") if not c.name.endswith("-end.frk")]
    assert len(kept) == 2 and all(shardfiles.problem(c) is None for c in kept)  # keep=2, each a folder that verifies
    assert all(len(list(c.glob("shard-*"))) == 2 for c in kept)
    assert not list(models.glob("**/.*tmp*"))


@pytest.mark.slow
def test_sigkill_of_one_rank_mid_save_leaves_no_checkpoint_and_autoresume_takes_the_previous(tmp_root, tmp_path):
    ref = reference(tmp_root, 2)
    args = ("--auto", "4")
    p = launch(2, tmp_path, tmp_path / "out.frk", *args, "--kill-in-save", "1,3", ok=False)
    assert p.returncode != 0 and "rank 1: SIGKILL in a save" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    folders = sorted((tmp_path / "models").glob("auto-*-i*.frk"))
    assert [f.name[-15:] for f in folders] == ["i0000000004.frk", "i0000000008.frk", "i0000000012.frk"]
    third = folders[-1]
    # both ranks' files of the third save are complete and verify on their own; without the manifest,
    # which rank 0 writes only once every rank has said its file is committed, it is no checkpoint
    assert [fr.info(f, verify=True)["size"] > 0 for f in sorted(third.glob("shard-*"))] == [True, True]
    assert not stored.exists(third) and "no manifest.frk" in shardfiles.problem(third)
    p = launch(2, tmp_path, tmp_path / "out.frk", *args)
    assert "i0000000008.frk" in p.stdout.split("AutoCheckpoint: found")[1].splitlines()[0]
    assert_same_on_every_rank(ref, ranks(tmp_path / "out.frk", 2), 2)


@pytest.mark.slow
def test_a_checkpoint_with_a_shard_missing_is_refused_on_every_rank(tmp_root, tmp_path):
    folder = from_killed(tmp_root, tmp_path, 2, 1, 10)
    next(folder.glob("shard-00001-*")).unlink()
    p = launch(2, tmp_path, tmp_path / "res.frk", "--resume", "crash", ok=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and out.count("rank 1's file") >= 2, out[-3000:]  # said on both ranks, no hang


@pytest.mark.slow
def test_a_sharded_fits_remote_holds_every_ranks_file_and_a_new_machine_resumes_bitwise(tmp_root, tmp_path):
    """AutoCheckpoint(remote=...) of a sharded fit: each rank uploads its own file, rank 0 the manifest, and the
    marker, last, names every rank's file with its size and CRC32C. The machine lost (every rank SIGKILLed, its
    disk deleted): `verify URL` reads every rank's file, and a new machine with an empty disk downloads the
    newest checkpoint and resumes bitwise on every rank; its remote ends with its last checkpoint."""
    ref = reference(tmp_root, 2)
    remote, m1, m2 = tmp_path / "remote", tmp_path / "machine1", tmp_path / "machine2"
    url, args = remote.as_uri() + "/", ("--auto", "4", "--slow-ms", "40")
    for m in (m1, m2):
        m.mkdir()
    p = launch(2, m1, m1 / "out.frk", *args, "--remote", url, "--die-at", "1,5", ok=False)
    assert p.returncode != 0 and "SIGKILL" in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
    done = sorted(m.name[: -len(".done")] for m in remote.glob("auto-*-i*.frk.done"))
    assert done, sorted(x.name for x in remote.iterdir())
    for name in done:
        marker = json.loads((remote / (name + ".done")).read_text())
        objects = sorted(f.name for f in (remote / name).iterdir())
        shards = [f for f in objects if f.startswith("shard-") and not f.endswith(".done")]
        assert [part["file"] for part in marker["parts"]] == shards and len(shards) == 2
        assert "manifest.frk" in objects and marker["world_size"] == 2
        assert [part["size"] for part in marker["parts"]] == [(remote / name / f).stat().st_size for f in shards]
    shutil.rmtree(m1)
    v = subprocess.run([sys.executable, "-m", "fastai_resume", "verify", url], capture_output=True, text=True, env=ENV)
    assert v.returncode == 0 and f"{len(done)} ok, 0 bad" in v.stdout, v.stdout + v.stderr
    i = subprocess.run(
        [sys.executable, "-m", "fastai_resume", "inspect", url + done[-1]], capture_output=True, text=True, env=ENV
    )
    assert i.returncode == 0 and "sharded checkpoint of 2 ranks" in i.stdout, i.stdout + i.stderr
    from trainer import build

    with pytest.raises(ValueError, match="a sharded checkpoint's folder .* AutoCheckpoint\\(remote=...\\) resumes"):
        objstore.fetch(build(m2), url + done[-1])  # learn.load(URL) of one: said what to do, nothing written
    assert not (m2 / "models").exists()

    p = launch(2, m2, m2 / "out.frk", *args, "--remote", url)
    assert f"AutoCheckpoint: downloaded {done[-1]}" in p.stdout, p.stdout[-3000:]
    assert_same_on_every_rank(ref, ranks(m2 / "out.frk", 2), 2)
    last = sorted(c.name for c in (m2 / "models").glob("auto-*-i*.frk"))[-1]
    assert (remote / (last + ".done")).exists() and len(list((remote / last).glob("shard-*.frk"))) == 2


@pytest.mark.slow
def test_a_sharded_fit_goes_on_through_a_remote_outage_and_its_remote_catches_up(tmp_root, tmp_path):
    """The S3-API server becomes unreachable during a sharded fit (the relay in front of it killed), then comes
    back: every rank trains on and ends as the uninterrupted run, each rank says how far behind its uploads are,
    the ranks' uploads retry and catch up while training goes on (checkpoints removed locally meanwhile are
    dropped, not retried), and the remote ends with the run's last checkpoint, every rank's file in it."""
    server = Server()
    proxy = Proxy(server.port)
    try:
        server.fs().mkdir("outage")
        url = "s3://outage/run/"
        env = dict(ENV, PYTHONUNBUFFERED="1", **server.env(proxy.endpoint))
        cmd = torchrun(2, tmp_path, tmp_path / "out.frk", "--auto", "4", "--slow-ms", "300", "--remote", url)
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
        reader.start()
        fs = server.fs()

        def complete():
            try:
                names = {os.path.basename(k.rstrip("/")) for k in fs.ls("outage/run", detail=False)}
            except FileNotFoundError:
                return []
            return sorted(n for n in names if "-i" in n and n.endswith(".frk") and n + ".done" in names)

        def wait_for(cond, what):
            t0 = time.monotonic()
            while not cond():
                assert p.poll() is None, f"the run ended before {what}:" + "".join(lines)[-3000:]
                assert time.monotonic() - t0 < 300, f"no {what}:" + "".join(lines)[-3000:]
                time.sleep(0.05)

        wait_for(complete, "a first upload")
        proxy.stop()
        before = complete()[-1]
        wait_for(lambda: "behind" in "".join(lines), "the warning")
        proxy.start()
        wait_for(lambda: complete()[-1] > before, "an upload after the outage")
        training = "".join(lines)
        assert "behind" in training and "(waiting up to" not in training, training[-3000:]  # both while it trains
        assert p.wait(600) == 0, "".join(lines)[-3000:]
        reader.join(30)
    finally:
        proxy.stop()
    try:
        out = "".join(lines)
        assert re.search(r"AutoCheckpoint: the remote \S+ is \d+ checkpoints? behind", out), out[-3000:]
        last = sorted(c.name for c in (tmp_path / "models").glob("auto-*-i*.frk"))[-1]
        assert complete()[-1] == last, out[-3000:]
        assert len([k for k in fs.ls(f"outage/run/{last}", detail=False) if k.endswith(".frk.done")]) == 2
    finally:
        server.stop()
    assert_same_on_every_rank(reference(tmp_root, 2), ranks(tmp_path / "out.frk", 2), 2)


def _saved_state(tmp_root, n, epoch, k):
    d = killed(tmp_root, n, epoch, k)
    return [fr.load(os.path.join(d, f"dead.frk.rank{r}.saved")) for r in range(n)]


def _assert_rebuilt(start, saved, r):
    "The state a rank loaded: every parameter and optimizer state whole as saved; its own BatchNorm statistics."
    for k in PARAMS:
        assert torch.equal(start["full_model"][k], saved[0]["full_model"][k]), k
    assert equal(start["full_opt"]["state"], saved[0]["full_opt"]["state"])
    own = saved[r] if r < len(saved) else saved[0]  # a rank the saved run did not have: rank 0's
    for k in BUFFERS:
        assert torch.equal(start["full_model"][k], own["full_model"][k]), k


@pytest.mark.slow
def test_a_2_rank_checkpoint_continues_on_4_ranks_and_on_1_rebuilt_exactly_and_said_plainly(tmp_root, tmp_path):
    saved = _saved_state(tmp_root, 2, 1, 10)
    ref = reference(tmp_root, 2)
    from_killed(tmp_root, tmp_path, 2, 1, 10)
    p = launch(4, tmp_path, tmp_path / "four.frk", "--resume", "crash", "--dump-state")
    assert p.stdout.count("is no longer the uninterrupted run's") == 4
    assert p.stdout.count("at epoch 1, iteration 5/12") == 4  # 640 samples done = 5 batches of 4 ranks
    for r in range(4):
        _assert_rebuilt(fr.load(tmp_path / f"four.frk.rank{r}.start"), saved, r)
    four = ranks(tmp_path / "four.frk", 4)
    assert len(four[0]["losses"]) == N_ITER[2] + 10 + (11 - 5) + 11  # the saved history, then 4 ranks' batches
    assert not equal(four[0]["full_model"], ref[0]["full_model"])  # indeed not the uninterrupted run's result
    # one process, no process group, a model that is not sharded: every tensor gathered from both files
    one = [sys.executable, os.path.join(HERE, "trainer.py"), "--bn", "--path", str(tmp_path), "--out"]
    p = FORKS.run(one + [str(tmp_path / "one.frk"), "--resume", "crash", "--dump-state"], ENV, 900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "at epoch 1, iteration 20/46" in p.stdout and "no longer the uninterrupted run's" in p.stdout
    start1 = fr.load(tmp_path / "one.frk.start")
    start1 = {"full_model": start1["model"], "full_opt": start1["opt"]}
    _assert_rebuilt(start1, saved, 0)


@pytest.mark.slow
def test_a_1_process_checkpoint_continues_on_2_ranks_and_a_partial_accumulation_is_refused(tmp_path):
    one = [sys.executable, os.path.join(HERE, "trainer.py"), "--bn", "--path", str(tmp_path), "--out"]
    p = FORKS.run(one + [str(tmp_path / "dead.frk"), "--die-at", "1,20"], ENV, 900)
    assert p.returncode == -signal.SIGKILL
    saved = fr.load(tmp_path / "models" / "crash.frk")
    p = launch(2, tmp_path, tmp_path / "two.frk", "--resume", "crash", "--dump-state")
    assert p.stdout.count("at epoch 1, iteration 10/23") == 2
    for r in range(2):
        start = fr.load(tmp_path / f"two.frk.rank{r}.start")
        assert equal({k: start["full_model"][k] for k in PARAMS}, {k: saved["model"][k] for k in PARAMS})
        assert equal(start["full_opt"]["state"], saved["opt"]["state"])
    # saved between two optimizer steps of a gradient accumulation: the partial sums cannot move
    p = FORKS.run(one + [str(tmp_path / "dead.frk"), "--die-at", "1,21", "--grad-acc", "64"], ENV, 900)
    assert p.returncode == -signal.SIGKILL
    assert fr.load(tmp_path / "models" / "crash.frk")["train"]["grads"] is not None
    p = launch(2, tmp_path, tmp_path / "two.frk", "--resume", "crash", "--grad-acc", "64", ok=False)
    assert p.returncode != 0 and "in the middle of a gradient accumulation" in p.stderr


@pytest.mark.slow
def test_inspect_and_verify_say_which_rank_wrote_what(tmp_root, tmp_path, capsys):
    folder = from_killed(tmp_root, tmp_path, 2, 1, 10)
    assert cli(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "sharded checkpoint of 2 ranks" in out and "position: epoch 1 of 3, 10 of 23" in out
    assert re.search(r"model\.0\.weight +\[37, 64\] +rank 0: \[0:19\] +rank 1: \[19:37\]", out), out
    assert cli(["verify", str(folder)]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_with_nccl_a_killed_run_resumes_bitwise(tmp_path):
    n = min(2, torch.cuda.device_count())
    args = ("--cuda", "--no-noise")
    launch(n, tmp_path / "ref", tmp_path / "ref" / "out.frk", *args)
    p = launch(n, tmp_path / "run", tmp_path / "run" / "dead.frk", "--die-at", "1,7", *args, ok=False)
    assert p.returncode != 0
    launch(n, tmp_path / "run", tmp_path / "run" / "res.frk", "--resume", "crash", *args)
    ref, res = ranks(tmp_path / "ref" / "out.frk", n), ranks(tmp_path / "run" / "res.frk", n)
    for a, b in zip(ref, res):
        for key in KEYS:
            assert equal(a[key], b[key]), key


# ---- a partly frozen sharded model: its checkpoints hold what trains ----------------------------------

FROZEN = ("0.weight", "0.bias")  # trainer.py --freeze: the first layer frozen, as a fine-tune freezes a base


@pytest.mark.slow
def test_a_partly_frozen_sharded_model_checkpoints_what_trains_and_resumes_bitwise_on_every_rank(tmp_root, tmp_path):
    ref = reference(tmp_root, 2, "--freeze")
    folder = from_killed(tmp_root, tmp_path, 2, 1, 5, "--freeze")
    saved = fr.load(os.path.join(killed(tmp_root, 2, 1, 5, "--freeze"), "dead.frk.rank0.saved"))["full_model"]
    m = shardfiles.read_manifest(folder)
    for s in m["shards"]:  # no rank holds any part of the frozen layer: each names it by the whole tensor's CRC32C
        tree = fr.load(folder / s["file"])
        assert not set(FROZEN) & set(tree["model"]) and set(tree["frozen"]) == set(FROZEN)
        for k in FROZEN:
            whole = saved[k].contiguous().view(-1).view(torch.uint8).numpy()
            assert tree["frozen"][k] == {"crc": io.crc32c(whole), "shape": list(saved[k].shape), "dtype": "float32"}
    p = launch(2, tmp_path, tmp_path / "res.frk", "--resume", "crash", "--freeze")
    assert p.stdout.count("at epoch 1, iteration 5/23") == 2
    assert_same_on_every_rank(ref, ranks(tmp_path / "res.frk", 2), 2)
    # make_full on every rank: a sharded checkpoint holding every tensor (the frozen layer's from the learner,
    # checked first), which resumes the run exactly, also on a learner built on another base
    p = launch(2, tmp_path, tmp_path / "full.frk", "--resume", "crash", "--make-full", "full", "--freeze")
    for s in shardfiles.read_manifest(tmp_path / "models" / "full.frk")["shards"]:
        tree = fr.load(tmp_path / "models" / "full.frk" / s["file"])
        assert set(FROZEN) <= set(tree["model"]) and "frozen" not in tree
    assert_same_on_every_rank(ref, ranks(tmp_path / "full.frk", 2), 2)
    launch(2, tmp_path, tmp_path / "other.frk", "--resume", "full", "--freeze", "--other-base")
    assert_same_on_every_rank(ref, ranks(tmp_path / "other.frk", 2), 2)


@pytest.mark.slow
def test_a_sharded_delta_moves_between_world_sizes_and_another_base_is_refused_on_every_rank(tmp_root, tmp_path):
    folder = from_killed(tmp_root, tmp_path, 2, 1, 5, "--freeze")
    one = lambda d, *args: subprocess.run(  # noqa: E731  (one process, the model not sharded)
        trainer_cmd(d, d / "out.frk", "--bn", "--freeze", *args), capture_output=True, text=True, env=ENV, timeout=600
    )
    # 2 ranks -> 1 process: the whole tensor's fingerprint is the unsharded tensor's CRC32C
    p = one(tmp_path, "--resume", "crash")
    assert p.returncode == 0 and "resuming" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    p = one(tmp_path, "--resume", "crash", "--other-base")
    assert p.returncode != 0 and "the frozen tensor 0.weight is not the one" in p.stderr, p.stderr[-3000:]
    # another base at the saved world size: refused on every rank, naming the tensor, nothing trained
    p = launch(2, tmp_path, tmp_path / "bad.frk", "--resume", "crash", "--freeze", "--other-base", ok=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and all(
        f"[rank{r}]: fastai_resume.CheckpointError: {folder}: the frozen tensor 0.weight" in out for r in (0, 1)
    ), out[-4000:]
    assert not (tmp_path / "bad.frk.rank0").exists()
    # 1 process -> 2 ranks: a single process's delta file into a sharded model
    d = tmp_path / "single"
    p = one(d, "--die-at", "1,5")
    assert p.returncode == -signal.SIGKILL and (d / "models" / "crash.frk").is_file(), p.stderr[-2000:]
    assert set(fr.load(d / "models" / "crash.frk")["frozen"]) == set(FROZEN)
    p = launch(2, d, d / "two.frk", "--resume", "crash", "--freeze")
    assert p.stdout.count("resuming") == 2
    p = launch(2, d, d / "bad.frk", "--resume", "crash", "--freeze", "--other-base", ok=False)
    assert p.returncode != 0 and (p.stdout + p.stderr).count("the frozen tensor 0.weight is not the one") >= 2
