"""Resume under torch.distributed: 2 processes on the CPU (gloo), launched by torchrun as a user
launches them, training inside fastai's `distrib_ctx` (Accelerate's DDP and fastai's
DistributedDL). Each rank draws its own augmentation noise and dropout masks, so per-rank RNG
state matters; every comparison is made on every rank against the uninterrupted 2-process run."""

import functools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from procs import ENV, FORKS, HERE, equal, kill_job, run_name, shared_run, start, torchrun_trainer, wait_for_line

import fastai_resume as fr

N_ITER = 23  # per rank: 1500 digits split over 2 ranks, bs 32, drop_last
BS = 32
KEYS = ("model", "opt", "losses", "lrs", "values")
pytestmark = pytest.mark.slow  # every test launches 2-process jobs (3 interpreters each)


def torchrun(path, out, *args):
    return torchrun_trainer(2, path, out, "--ddp", *args)


def launch(path, out, *args, ok=True):
    p = subprocess.run(torchrun(path, out, *args), capture_output=True, text=True, env=ENV, timeout=600)
    if ok:
        assert p.returncode == 0, p.stdout + p.stderr[-5000:]
    return p


def ranks(out):
    return [fr.load(f"{out}.rank{r}") for r in (0, 1)]


@functools.cache
def reference(tmp_root, *args):
    make = lambda d: launch(d, os.path.join(d, "out.frk"), *args)  # noqa: E731
    return shared_run(tmp_root, run_name("ddp-ref", args), make, ("out.frk.rank0", "out.frk.rank1"))


@functools.cache
def killed(tmp_root, epoch, k):
    """The folder of a 2-process run that saved `crash` at (epoch, k) and was then killed by SIGKILL on
    both ranks, made once for every test that resumes from that point."""

    def make(d):
        p = launch(d, os.path.join(d, "dead.frk"), "--die-at", f"{epoch},{k}", ok=False)
        assert p.returncode != 0 and "SIGKILL" in p.stdout + p.stderr  # both ranks died hard after the save
        fr.save({"returncode": p.returncode}, os.path.join(d, "killed.frk"))  # last: the run is complete

    shared_run(tmp_root, f"ddp-killed-{epoch}-{k}", make, ("killed.frk",))
    return os.path.join(tmp_root, f"ddp-killed-{epoch}-{k}")


def from_killed(tmp_root, tmp_path, epoch, k):
    "The checkpoint a killed 2-process run saved at (epoch, k), copied into this test's models folder."
    (tmp_path / "models").mkdir(exist_ok=True)
    shutil.copy(os.path.join(killed(tmp_root, epoch, k), "models", "crash.frk"), tmp_path / "models")
    return fr.load(tmp_path / "models" / "crash.frk")


def assert_same_on_every_rank(ref, res):
    for r, (a, b) in enumerate(zip(ref, res)):
        assert len(b["losses"]) == 3 * N_ITER
        for key in KEYS:
            assert equal(a[key], b[key]), f"rank {r}: {key} differs from the uninterrupted run"


def test_the_reference_run_shards_every_epoch_across_the_ranks(tmp_root):
    ref = reference(tmp_root)
    for e in ("0", "1", "2"):
        both = torch.cat([ref[0]["seen"][e], ref[1]["seen"][e]])
        assert sorted(both.tolist()) == list(range(1500))  # every item once per epoch, across ranks
    assert not torch.equal(ref[0]["seen"]["0"], ref[0]["seen"]["1"])  # reshuffled each epoch
    assert equal(ref[0]["model"], ref[1]["model"])  # DDP: one model
    assert ref[0]["losses"] == ref[1]["losses"]  # fastai gathers the loss over the ranks


@pytest.mark.parametrize("epoch,k", [(0, 1), (1, 10), (2, N_ITER - 1)], ids=["first-batch", "middle", "last-epoch"])
def test_kill_at_iteration_k_then_resume_is_bitwise_equal_on_every_rank(tmp_root, tmp_path, epoch, k):
    ref = reference(tmp_root)
    ck = from_killed(tmp_root, tmp_path, epoch, k)["train"]  # both ranks died by SIGKILL after the save
    assert ck["position"]["world_size"] == 2 and (ck["position"]["epoch"], ck["position"]["iter"]) == (epoch, k)
    assert ck["ranks"][0] is None and not equal(ck["ranks"][1]["rng"]["torch"], ck["rng"]["torch"])
    p = launch(tmp_path, tmp_path / "res.frk", "--resume", "crash")
    assert p.stdout.count(f"at epoch {epoch}, iteration {k}/{N_ITER}") == 2  # both ranks, same place
    res = ranks(tmp_path / "res.frk")
    assert_same_on_every_rank(ref, res)
    for r in (0, 1):  # each rank skipped its own share and loaded the rest of it, nothing else
        assert equal(res[r]["seen"][str(epoch)], ref[r]["seen"][str(epoch)][k * BS :])
        assert str(epoch - 1) not in res[r]["seen"]


def test_two_loader_workers_per_rank_resume_bitwise_equal(tmp_root, tmp_path):
    "Without random item transforms (those draw from worker RNG; see the README), workers are exact."
    args = ("--workers", "2", "--no-noise")
    ref = reference(tmp_root, *args)
    launch(tmp_path, tmp_path / "dead.frk", "--die-at", "1,10", *args, ok=False)
    launch(tmp_path, tmp_path / "res.frk", "--resume", "crash", *args)
    assert_same_on_every_rank(ref, ranks(tmp_path / "res.frk"))


def test_negative_control_every_rank_resuming_with_rank0s_rng_breaks_equality(tmp_root, tmp_path):
    ref = reference(tmp_root)
    from_killed(tmp_root, tmp_path, 1, 10)
    launch(tmp_path, tmp_path / "res.frk", "--resume", "crash", "--shared-rng")
    res = ranks(tmp_path / "res.frk")
    assert res[0]["losses"][: N_ITER + 10] == ref[0]["losses"][: N_ITER + 10]  # restored history is fine
    assert not equal(ref[1]["losses"], res[1]["losses"])
    assert not equal(ref[0]["model"], res[0]["model"])


def test_another_world_size_continues_counted_in_samples_says_so_or_restarts_an_epoch_on_request(tmp_root, tmp_path):
    from_killed(tmp_root, tmp_path, 1, 10)
    single = [
        sys.executable,
        os.path.join(HERE, "trainer.py"),
        "--path",
        str(tmp_path),
        "--out",
        str(tmp_path / "one.frk"),
    ]
    p = FORKS.run(single + ["--resume", "crash"], ENV, 600)
    assert p.returncode == 0, p.stderr
    # 10 batches of 32 on each of 2 ranks: 640 samples of epoch 1 done, 20 batches of the one process
    assert "saved by 2 process(es) and this fit runs 1" in p.stdout and "at epoch 1, iteration 20/46" in p.stdout
    assert "no longer the uninterrupted run's" in p.stdout
    res = fr.load(tmp_path / "one.frk")
    assert len(res["seen"]["1"]) == 1500 - 20 * BS and len(res["losses"]) == N_ITER + 10 + (46 - 20) + 46
    assert not equal(res["model"], reference(tmp_root)[0]["model"])  # as said: not the 2-process run's result
    # an explicit start_epoch starts that epoch from the checkpoint's model and optimizer
    p = FORKS.run(single + ["--resume", "crash", "--start-epoch", "2"], ENV, 600)
    assert p.returncode == 0, p.stderr
    assert "at epoch 2, iteration 0/46" in p.stdout
    assert len(fr.load(tmp_path / "one.frk")["seen"]["2"]) == 1500


@pytest.mark.parametrize(
    "trial,every", [(0, ("--auto", "4")), (1, ("--auto-seconds", "0.15"))], ids=["every_iters", "every_seconds"]
)
def test_autocheckpoint_sigkill_of_the_whole_job_then_autoresume_is_bitwise_equal(tmp_root, tmp_path, trial, every):
    ref = reference(tmp_root)
    rng = random.Random(trial)
    args = every + ("--slow-ms", "20")  # every_seconds: rank 0's clock, agreed by both ranks
    for row in ("[0, ", "[1, "):  # kill the launcher and both ranks mid-epoch, twice
        p = start(torchrun(tmp_path, tmp_path / "out.frk", *args), start_new_session=True)
        wait_for_line(p, row)
        time.sleep(rng.uniform(0.05, 0.4))
        kill_job(p)  # the launcher and both ranks (each in a session of its own)
    models = tmp_path / "models"
    assert fr.load(sorted(models.glob("auto-*.frk"))[-1])["train"]["position"]["world_size"] == 2
    launch(tmp_path, tmp_path / "out.frk", *args)
    assert_same_on_every_rank(ref, ranks(tmp_path / "out.frk"))
    assert not list(models.glob(".*tmp*"))
    assert len([p for p in models.glob("auto-*.frk") if not p.name.endswith("-end.frk")]) == 2  # keep=2, rank 0 only


def test_sigterm_to_the_launcher_saves_on_every_rank_at_one_batch_and_resumes_exactly(tmp_root, tmp_path):
    ref = reference(tmp_root)
    args = ("--auto", "100000", "--slow-ms", "30")
    p = start(torchrun(tmp_path, tmp_path / "out.frk", *args))
    seen = wait_for_line(p, "[0, ")
    p.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    out = "".join(seen) + p.communicate(timeout=120)[0]
    saved = re.findall(r"AutoCheckpoint: SIGTERM: saved (auto-\S+\.frk)", out)  # the ranks' lines may interleave
    assert len(saved) == 2 and saved[0] == saved[1], out  # both ranks agreed on one batch
    name = saved[0]
    pos = fr.load(tmp_path / "models" / name)["train"]["position"]
    assert pos["epoch"] >= 1 and pos["world_size"] == 2
    launch(tmp_path, tmp_path / "out.frk", *args)
    assert_same_on_every_rank(ref, ranks(tmp_path / "out.frk"))


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_a_save_failing_on_rank0_stops_every_rank_promptly_and_keeps_the_old_files(tmp_path, mode):
    "A full disk on rank 0 (RLIMIT_FSIZE) must raise on every rank, not leave rank 1 waiting for it."
    args = ("--auto", "5", "--ballast-mb", "8", "--fsize-mb", "4") + (("--auto-sync",) if mode == "sync" else ())
    t0 = time.monotonic()
    p = launch(tmp_path, tmp_path / "out.frk", *args, ok=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and time.monotonic() - t0 < 240, out[-3000:]  # not a process-group timeout
    assert "File too large" in out and "previous" in out
    assert "[rank1]" in out and ("rank 0's save failed" in out or "was not saved (rank 0: " in out), out[-3000:]
    assert not list((tmp_path / "models").glob(".*tmp*"))
