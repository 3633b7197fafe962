"""Several machines without a shared disk: two torchrun agents (`--nnodes 2 --nproc_per_node 1`, gloo on the
CPU), each in a mount namespace of its own where the same folder (the script's working folder, fastai's
default relative paths under it) is that node's own disk: what one node writes there the other never sees.
Every process of both nodes is killed by SIGKILL, then the same two commands run again; every rank's result
is compared bitwise with the uninterrupted two-node run, or the rerun must fail on every rank, promptly,
saying why. Needs root for `unshare -m` (CI runs as root); skipped elsewhere."""

import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest
from procs import ENV, HERE, descendants, equal, shared_run
from s3server import Server

import fastai_resume as fr

pytestmark = pytest.mark.slow
KEYS = ("model", "opt", "losses", "lrs", "values")
AUTO = re.compile(r"^auto-\w+-g\d{3}-s\d{3}-f\d{2}-e\d{6}-i\d{10}\.frk$")


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if not _namespaces_work():
    pytest.skip("mount namespaces (unshare -m) need root here", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_cmd(root, node, port, *args, script="trainer.py"):
    """Node `node`'s torchrun agent, in a mount namespace where `root/work` is `root/node<node>`."""
    work, disk = os.path.join(root, "work"), os.path.join(root, f"node{node}")
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    run += ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    run += [os.path.join(HERE, script), "--path", work, "--out", os.path.join(work, "out.frk"), *args]
    run += ["--ddp"] if script == "trainer.py" else []
    inner = f"mount --bind {shlex.quote(disk)} {shlex.quote(work)} && cd {shlex.quote(work)} && exec {shlex.join(run)}"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]


def start_nodes(root, *args, env=None, out=subprocess.PIPE, script="trainer.py") -> list:
    "Both nodes' agents with `args`, started (Popen objects; `out`: where their merged output goes)."
    for d in ("work", "node0", "node1"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    port = _free_port()
    env = dict(ENV, PYTHONUNBUFFERED="1", **(env or {}))
    return [
        subprocess.Popen(
            node_cmd(root, n, port, *args, script=script), stdout=out, stderr=subprocess.STDOUT, text=True, env=env
        )
        for n in (0, 1)
    ]


def kill_nodes(ps) -> None:
    "SIGKILL to every process of both nodes (each rank is in a session of its own: killpg would miss them)."
    for p in ps:
        for pid in descendants(p.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    for p in ps:
        p.wait(60)


def two_nodes(root, *args, env=None, timeout=300, script="trainer.py"):
    """Both nodes' agents with `args`; (their return codes, their outputs). A job still running after
    `timeout` seconds is a hang: killed, and the test fails saying so."""
    ps = start_nodes(root, *args, env=env, script=script)
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in ps]
    except subprocess.TimeoutExpired:
        kill_nodes(ps)
        pytest.fail(f"the two-node job {args} hangs (still running after {timeout} s)")
    return [p.returncode for p in ps], outs


def results(root):
    return [fr.load(os.path.join(root, f"node{r}", f"out.frk.rank{r}")) for r in (0, 1)]


def assert_exact(ref, res):
    for r, (a, b) in enumerate(zip(ref, res)):
        for key in KEYS:
            assert equal(a[key], b[key]), f"rank {r}: {key} differs from the uninterrupted two-node run"


@functools.cache
def reference(tmp_root, *args):
    "The uninterrupted two-node run with `args`, once per session."

    def make(d):
        rc, outs = two_nodes(d, *args)
        assert rc == [0, 0], outs
        for r in (0, 1):
            shutil.copy(os.path.join(d, f"node{r}", f"out.frk.rank{r}"), os.path.join(d, f"ref.rank{r}"))

    return shared_run(tmp_root, "nodes-ref" + "".join(args), make, ("ref.rank0", "ref.rank1"))


def killed(root, *args):
    "Both nodes' processes die by SIGKILL (every rank, right after rank 0 saved `crash` at epoch 1, batch 5)."
    rc, outs = two_nodes(root, "--die-at", "1,5", *args)
    assert all(c != 0 for c in rc) and "SIGKILL" in "".join(outs), outs
    return outs


def test_a_load_on_the_node_that_has_the_file_resumes_every_rank_exactly(tmp_root, tmp_path):
    """The script loads `crash` where its disk has it (`os.path.exists`): rank 0's node. Rank 1 loads nothing;
    it is served rank 0's file as its fit begins and resumes from it: bitwise on both ranks."""
    ref = reference(tmp_root)
    killed(tmp_path)
    assert (tmp_path / "node0" / "models" / "crash.frk").exists() and not (tmp_path / "node1" / "models").exists()
    rc, outs = two_nodes(tmp_path, "--resume", "crash", "--resume-if-saved")
    assert rc == [0, 0], outs
    assert "rank 1 resumes from rank 0's" in outs[1], outs[1]
    assert_exact(ref, results(tmp_path))
    assert not (tmp_path / "node1" / "models").exists()  # nothing written on node 1's disk


def test_autocheckpoint_resumes_every_rank_exactly_from_rank0s_disk(tmp_root, tmp_path):
    ref = reference(tmp_root)
    killed(tmp_path, "--auto", "4")
    autos = sorted((tmp_path / "node0" / "models").glob("auto-*.frk"))
    assert autos and not (tmp_path / "node1" / "models").exists()
    rc, outs = two_nodes(tmp_path, "--auto", "4")
    assert rc == [0, 0], outs
    assert "AutoCheckpoint: found" in outs[0] and "AutoCheckpoint: found" in outs[1]
    assert_exact(ref, results(tmp_path))


def test_two_fresh_nodes_resume_exactly_from_the_remote(tmp_root, tmp_path):
    "AutoCheckpoint(remote=...): both machines lost; two new ones with empty disks resume from the remote copy."
    ref = reference(tmp_root)
    remote = f"file://{tmp_path / 'remote'}/"
    killed(tmp_path, "--auto", "4", "--remote", remote)
    for n in (0, 1):  # new machines: nothing of the first run's on their disks
        shutil.rmtree(tmp_path / f"node{n}")
    rc, outs = two_nodes(tmp_path, "--auto", "4", "--remote", remote)
    assert rc == [0, 0], outs
    assert "downloaded" in outs[0], outs[0]
    assert_exact(ref, results(tmp_path))


@pytest.mark.parametrize("way", ["load", "auto"])
def test_fine_tune_killed_in_its_second_stage_resumes_every_rank_exactly(tmp_root, tmp_path, way):
    """fastai's `fine_tune` is two training calls: the frozen epoch, then the unfrozen ones. Killed in the
    second, the rerun passes the first on every rank with its end state (on rank 0's disk only, sent to
    rank 1), by `learn.load` where the file is or by AutoCheckpoint: bitwise on both ranks."""
    ref = reference(tmp_root, "--method", "fine_tune")
    args = ("--method", "fine_tune") + (("--auto", "4") if way == "auto" else ())
    killed(tmp_path, *args)
    assert not (tmp_path / "node1" / "models").exists()  # DDP: rank 0 alone writes
    again = args + (("--resume", "crash", "--resume-if-saved") if way == "load" else ())
    rc, outs = two_nodes(tmp_path, *again)
    assert rc == [0, 0], outs
    assert_exact(ref, results(tmp_path))
    assert not (tmp_path / "node1" / "models").exists()


def test_ranks_that_loaded_different_checkpoints_refuse_together(tmp_path):
    "Node 1's disk holds a `crash` of another run: each rank loads its own; every rank refuses, naming both."
    killed(tmp_path)
    other = tmp_path / "other"
    killed(other, "--epochs", "4")
    (tmp_path / "node1" / "models").mkdir()
    shutil.copy(other / "node0" / "models" / "crash.frk", tmp_path / "node1" / "models" / "crash.frk")
    rc, outs = two_nodes(tmp_path, "--resume", "crash", "--resume-if-saved", "--epochs", "3")
    assert rc[0] != 0 and rc[1] != 0, outs
    for out in outs:
        assert "the ranks loaded different checkpoints" in out, out[-3000:]


def test_a_rank_that_does_not_arrive_stops_every_rank_after_the_bounded_wait(tmp_path):
    """Rank 1 is elsewhere for 40 s (its script sleeps before training); with a 5 s bound rank 0 stops at its
    first step, naming the step and rank 1, instead of waiting for it."""
    t0 = time.monotonic()
    rc, outs = two_nodes(tmp_path, "--stall", "1,40", env={"FASTAI_RESUME_TIMEOUT": "5"}, timeout=200)
    assert rc[0] != 0 and rc[1] != 0, outs
    assert "rank(s) [1] of 2 did not arrive within 5 s" in outs[0], outs[0][-3000:]
    assert "stage 0: the checkpoint every rank resumes from" in outs[0]
    assert time.monotonic() - t0 < 150


def test_fsdp2_load_on_node_local_disks_resumes_every_rank_exactly_and_other_placements_refuse(tmp_root, tmp_path):
    """A sharded (FSDP2) model: each rank's file is on its own node's disk, the manifest on rank 0's. Each rank
    finds its own file, the manifest is sent to the ranks whose disk lacks it: bitwise on both ranks. With the
    nodes' disks swapped (each rank's file on the other node) every rank refuses, keeping every file."""
    ref = reference(tmp_root, "--fsdp", "--bn")
    rc, outs = two_nodes(tmp_path, "--fsdp", "--bn", "--die-at", "1,5")
    assert all(c != 0 for c in rc) and "SIGKILL" in "".join(outs), outs
    on = lambda n: sorted(p.name for p in (tmp_path / f"node{n}" / "models" / "crash.frk").iterdir())  # noqa: E731
    assert on(0)[0] == "manifest.frk" and len(on(0)) == 2 and len(on(1)) == 1 and on(1)[0].startswith("shard-00001")
    swapped = tmp_path / "swapped"
    for n in (0, 1):  # the same files, each on the other node
        shutil.copytree(tmp_path / f"node{n}" / "models", swapped / f"node{1 - n}" / "models")
    rc, outs = two_nodes(tmp_path, "--fsdp", "--bn", "--resume", "crash")
    assert rc == [0, 0], outs
    assert_exact(ref, results(tmp_path))
    assert len(on(1)) == 1  # the manifest's copy was not left on node 1's disk

    rc, outs = two_nodes(swapped, "--fsdp", "--bn", "--resume", "crash", timeout=200)
    assert rc[0] != 0 and rc[1] != 0, outs
    for out in outs:
        assert "is missing" in out and "a folder every node shares" in out, out[-3000:]
    assert sorted(p.name for p in (swapped / "node1" / "models" / "crash.frk").iterdir())[0] == "manifest.frk"


def test_fsdp2_autocheckpoint_on_node_local_disks_resumes_each_rank_from_its_own_nodes_file(tmp_root, tmp_path):
    """AutoCheckpoint of a sharded model, each node's disk its own: rank 0's holds the manifests and its files,
    rank 1's only its files. The rerun chooses together (the manifest sent, each rank checking its own file):
    bitwise on both ranks, and each node keeps only the checkpoints rank 0 keeps. A newest file corrupt on
    node 1: that checkpoint set aside on both disks, the one before resumed, exact. The disks swapped (every
    rank's file on the other node), or node 1 a new machine: every rank refuses, naming the files, and nothing
    is renamed or removed."""
    ref = reference(tmp_root, "--fsdp", "--bn")
    rc, outs = two_nodes(tmp_path, "--fsdp", "--bn", "--die-at", "1,5", "--auto", "4")
    assert all(c != 0 for c in rc) and "SIGKILL" in "".join(outs), outs
    autos = lambda n: sorted((tmp_path / f"node{n}" / "models").glob("auto-*.frk"))  # noqa: E731
    assert len(autos(0)) == len(autos(1)) >= 2
    assert all(len(list(d.iterdir())) == 1 for d in autos(1)), "node 1 holds rank 1's files only"
    corrupt, swapped = tmp_path / "corrupt", tmp_path / "swapped"
    for n in (0, 1):
        shutil.copytree(tmp_path / f"node{n}", corrupt / f"node{n}")
        shutil.copytree(tmp_path / f"node{n}" / "models", swapped / f"node{1 - n}" / "models")

    rc, outs = two_nodes(tmp_path, "--fsdp", "--bn", "--auto", "4")
    assert rc == [0, 0], outs
    assert "AutoCheckpoint: found" in outs[0] and "AutoCheckpoint: found" in outs[1]
    assert_exact(ref, results(tmp_path))
    assert [d.name for d in autos(0)] == [d.name for d in autos(1)] and len(autos(1)) <= 3  # keep=3 on each node

    newest = sorted((corrupt / "node1" / "models").glob("auto-*.frk"))[-1].name
    shard = next((corrupt / "node1" / "models" / newest).iterdir())
    with open(shard, "r+b") as f:  # a flipped byte in the middle of rank 1's newest file
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, outs = two_nodes(corrupt, "--fsdp", "--bn", "--auto", "4", "--show-warnings")
    assert rc == [0, 0], outs
    assert f"skipping {corrupt / 'work' / 'models' / newest}: rank 1's file" in outs[0], outs[0][-3000:]
    assert_exact(ref, results(corrupt))
    for n in (0, 1):  # set aside on both disks (not counted by retention, not removed)
        assert (corrupt / f"node{n}" / "models" / (newest + ".corrupt")).is_dir()

    files = lambda: sorted(  # noqa: E731  (the run's lock comes and goes with each process)
        str(p.relative_to(swapped)) for p in swapped.rglob("*") if p.is_file() and not p.name.endswith(".lock")
    )
    before = files()
    t0 = time.monotonic()
    rc, outs = two_nodes(swapped, "--fsdp", "--bn", "--auto", "4", timeout=200)
    assert rc[0] != 0 and rc[1] != 0, outs
    assert time.monotonic() - t0 < 120
    for out in outs:
        assert "rank 1 runs on another node than when it was saved" in out, out[-3000:]
        assert "launch each node with the same --node_rank as before" in out, out[-3000:]
    after = files()
    assert [f for f in before if f not in after] == [] and not [f for f in after if f.endswith(".corrupt")]

    new = tmp_path / "new"  # node 1 replaced by a new machine: an empty disk
    shutil.copytree(swapped / "node1", new / "node0")
    rc, outs = two_nodes(new, "--fsdp", "--bn", "--auto", "4", timeout=200)
    assert rc[0] != 0 and rc[1] != 0, outs
    for out in outs:
        assert "rank 1's file shard-00001-of-00002" in out and "is not on its node's disk" in out, out[-3000:]
    assert sorted(p.name for p in (new / "node0" / "models").glob("auto-*")) == sorted(
        p.name for p in (swapped / "node1" / "models").glob("auto-*")
    )


def test_fsdp2_one_node_replaced_resumes_exactly_from_the_remote(tmp_root, tmp_path):
    """Node 1 lost, node 0 kept its disk: the rerun takes from the remote what node 1's new disk lacks of the
    remote's newest checkpoint (rank 1's file), passes over newer ones node 0 alone holds, and every rank resumes
    bitwise."""
    ref = reference(tmp_root, "--fsdp", "--bn")
    args = ("--fsdp", "--bn", "--auto", "4", "--slow-ms", "40", "--remote", (tmp_path / "remote").as_uri() + "/")
    rc, outs = two_nodes(tmp_path, *args, "--die-at", "1,5")
    assert all(c != 0 for c in rc) and "SIGKILL" in "".join(outs), outs
    shutil.rmtree(tmp_path / "node1")
    rc, outs = two_nodes(tmp_path, *args)
    assert rc == [0, 0], outs
    assert "AutoCheckpoint: downloaded" in outs[0] and "what each rank's disk lacked" in outs[0], outs[0][-3000:]
    assert_exact(ref, results(tmp_path))


@pytest.fixture(scope="module")
def s3():
    server = Server()
    yield server
    server.stop()


def test_fsdp2_each_nodes_ranks_upload_their_files_and_two_fresh_nodes_resume_exactly(tmp_root, tmp_path, s3):
    """A sharded fit on two nodes whose disks are their own, mirrored to an S3-API server: each rank uploads
    the file its own node's disk holds. Both machines lost (every process SIGKILLed once the remote holds three
    checkpoints, both disks deleted); on the remote the newest is left as a kill mid-upload leaves it (no
    marker, rank 1's file without its own) and rank 1's object of the one before is deleted. Two new nodes with
    empty disks: the torn upload is no checkpoint, the one that lacks rank 1's file is named and set aside, the
    one before it downloaded (each rank's file onto its own node's disk, the manifest onto rank 0's),
    and every rank resumes bitwise; the remote ends with the new run's last checkpoint."""
    ref = reference(tmp_root, "--fsdp", "--bn")
    bucket = f"nodes{os.getpid()}"
    fs = s3.fs()
    fs.mkdir(bucket)
    url, args = f"s3://{bucket}/run/", ("--fsdp", "--bn", "--auto", "4", "--keep", "3", "--slow-ms", "100")

    def complete():
        try:
            names = {os.path.basename(k.rstrip("/")) for k in fs.ls(f"{bucket}/run", detail=False)}
        except FileNotFoundError:
            return []
        return sorted(n for n in names if AUTO.match(n) and n + ".done" in names)

    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    ps = start_nodes(tmp_path, *args, "--remote", url, env=s3.env(), out=log)
    t0 = time.monotonic()
    while len(complete()) < 3:
        assert all(p.poll() is None for p in ps), (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 240, "no three complete checkpoints on the remote"
        time.sleep(0.2)
    kill_nodes(ps)
    log.close()
    for n in (0, 1):  # new machines: nothing of the first run's on their disks
        shutil.rmtree(tmp_path / f"node{n}")
    *_, older, missing, torn = complete()
    part = lambda name, r: next(
        k for k in fs.ls(f"{bucket}/run/{name}", detail=False) if f"shard-0000{r}" in k and not k.endswith(".done")
    )  # noqa: E731
    fs.rm([f"{bucket}/run/{torn}.done", part(torn, 1) + ".done"])
    fs.rm(part(missing, 1))

    rc, outs = two_nodes(tmp_path, *args, "--remote", url, env=s3.env())
    assert rc == [0, 0], outs
    assert f"skipping {url}{missing}: rank 1: " in outs[0], outs[0][-3000:]
    assert f"AutoCheckpoint: downloaded {older}" in outs[0], outs[0][-3000:]
    assert_exact(ref, results(tmp_path))
    on = lambda n: [
        sorted(f.name for f in d.iterdir()) for d in sorted((tmp_path / f"node{n}" / "models").glob("auto-*-i*.frk"))
    ]  # noqa: E731
    assert on(1) and all(len(fs_) == 1 and fs_[0].startswith("shard-00001-") for fs_ in on(1))
    assert all(fs_[0] == "manifest.frk" and fs_[1].startswith("shard-00000-") and len(fs_) == 2 for fs_ in on(0))
    last = sorted(d.name for d in (tmp_path / "node0" / "models").glob("auto-*-i*.frk"))[-1]
    assert complete()[-1] == last  # (the positions after `older` saved again: `missing` and `torn` whole now)
    v = subprocess.run(
        [sys.executable, "-m", "fastai_resume", "verify", url],
        capture_output=True,
        text=True,
        env=dict(ENV, **s3.env()),
    )
    assert v.returncode == 0 and "3 ok, 0 bad" in v.stdout, v.stdout + v.stderr
    assert "without its marker" not in v.stdout, v.stdout  # nothing left of the torn or given-up uploads


def test_an_fsdp2_lora_fine_tune_on_two_nodes_lost_resumes_bitwise_from_each_ranks_uploads(tmp_path, s3):
    """The fine-tuner's case: a `transformers` model from `from_pretrained`, LoRA from peft, FSDP2 over two nodes
    whose disks are their own, AutoCheckpoint mirrored to an S3-API server. Each rank's object on the remote
    holds its part of what trains (the frozen base by fingerprint). Both nodes lost (SIGKILL, disks deleted):
    two new nodes resume from the remote bitwise on both ranks; on another base both ranks refuse, naming the
    tensor."""
    fs = s3.fs()
    bucket = f"lora{os.getpid()}"
    fs.mkdir(bucket)
    url, env = f"s3://{bucket}/run/", s3.env()
    lora = functools.partial(two_nodes, script="fsdp_lora.py", env=env)
    rc, outs = lora(tmp_path / "ref")
    assert rc == [0, 0], outs
    ref = [fr.load(tmp_path / "ref" / f"node{r}" / f"out.frk.rank{r}") for r in (0, 1)]
    auto = ("--auto", "2", "--remote", url, "--slow-ms", "100")
    rc, outs = lora(tmp_path, *auto, "--die-at", "7")
    assert all(c != 0 for c in rc) and "SIGKILL" in "".join(outs), outs
    names = {os.path.basename(k.rstrip("/")) for k in fs.ls(f"{bucket}/run", detail=False)}
    done = sorted(n for n in names if AUTO.match(n) and n + ".done" in names)
    assert done, sorted(names)
    marker = json.loads(fs.cat_file(f"{bucket}/run/{done[-1]}.done"))
    for r, part in enumerate(marker["parts"]):  # each rank's object: its part of what trains, the base referenced
        (tmp_path / f"part{r}.frk").write_bytes(fs.cat_file(f"{bucket}/run/{done[-1]}/{part['file']}"))
        tree = fr.info(tmp_path / f"part{r}.frk", verify=True)["tree"]
        assert tree["model"] and all("lora_" in k for k in tree["model"]), sorted(tree["model"])
        assert len(tree["frozen"]) > 10
    for n in (0, 1):
        shutil.rmtree(tmp_path / f"node{n}")

    rc, outs = lora(tmp_path / "other", *auto, "--base-seed", "1", timeout=200)  # new nodes, another base
    assert rc[0] != 0 and rc[1] != 0, outs
    for out in outs:
        assert "is not the one this checkpoint was saved with" in out, out[-3000:]

    fresh = tmp_path / "again"  # new nodes, the base
    rc, outs = lora(fresh, *auto)
    assert rc == [0, 0], outs
    assert f"AutoCheckpoint: downloaded {done[-1]}" in outs[0], outs[0][-3000:]
    for r in (0, 1):
        res = fr.load(fresh / f"node{r}" / f"out.frk.rank{r}")
        assert equal(ref[r]["losses"], res["losses"]) and equal(ref[r]["params"], res["params"]), f"rank {r}"
