"""Running tests/trainer.py as a real process, and comparing what runs produced."""

import contextlib
import functools
import os
import signal
import subprocess
import sys

import pytest
import torch
from filelock import FileLock
from forkserver import Pool

import fastai_resume as fr

HERE = os.path.dirname(os.path.abspath(__file__))
N_ITER = 46  # 1500 training digits, bs 32, drop_last


ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
FORKS = Pool()  # runs of training scripts fork from interpreters that imported torch and fastai (forkserver.py)


def trainer_cmd(path, out, *args):
    return [sys.executable, os.path.join(HERE, "trainer.py"), "--path", str(path), "--out", str(out), *args]


def torchrun_trainer(n, path, out, *args):
    "tests/trainer.py as an `n`-process job launched as torchrun launches it."
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    return launch + trainer_cmd(path, out, *args)[1:]


def start(cmd, **kw):
    "Popen of `cmd` with unbuffered, merged output to read line by line."
    return subprocess.Popen(
        cmd, env=dict(ENV, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def wait_for_line(p, prefix) -> list:
    "Reads `p`'s output until a line holds `prefix` (ranks' lines may interleave); returns the lines read."
    seen = []
    for line in p.stdout:
        seen.append(line)
        if prefix in line:
            return seen
    raise AssertionError("".join(seen))


def descendants(pid) -> list:
    "`pid` and every process below it (torchrun starts each rank in a session of its own: killpg misses them)."
    kids: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def kill_job(p) -> None:
    "SIGKILL the launcher `p` (a Popen) and every process it started, the ranks included, at once; then reap it."
    for q in descendants(p.pid):
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.communicate()


def run(path, out, *args, expect_kill=False):
    p = FORKS.run(trainer_cmd(path, out, *args), env=ENV, timeout=600)
    if expect_kill:
        assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    else:
        assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def shared_run(tmp_root, name, make, outs=("out.frk",)):
    """The files `outs` that `make(folder)` writes in `tmp_root/name`, made once for the whole test
    session: every pytest-xdist worker shares `tmp_root`, and the first to ask makes them under a
    lock while the others wait. The files are written last and atomically (`fastai_resume.save`),
    so their presence means a finished run."""
    d = os.path.join(tmp_root, name)
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, o) for o in outs]
    with FileLock(d + ".lock"):
        if not all(os.path.exists(p) for p in paths):
            make(d)
    return [fr.load(p) for p in paths]


def run_name(prefix, args):
    return prefix + "_".join(a.strip("-").replace("/", "_") for a in args)


@functools.cache
def reference(tmp_root, *args):
    "The uninterrupted run of tests/trainer.py with `args`, shared by the tests of one session."
    return shared_run(tmp_root, run_name("ref", args), lambda d: run(d, os.path.join(d, "out.frk"), *args))[0]


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_run(ref, res, epochs=3):
    assert len(res["losses"]) == len(ref["losses"]) == epochs * N_ITER
    for key in ("model", "opt", "losses", "lrs", "values"):
        assert equal(ref[key], res[key]), f"{key} differs from the uninterrupted run"


def workload_cmd(pipeline, path, out, *args):
    return [sys.executable, os.path.join(HERE, "workloads.py"), pipeline, "--path", str(path), "--out", str(out), *args]


def run_workload(pipeline, path, out, *args, expect=0):
    "Runs tests/workloads.py in a new process; `expect`: its exit status (-9: killed by SIGKILL)."
    p = FORKS.run(workload_cmd(pipeline, path, out, *args), env=ENV, timeout=900)
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


@functools.cache
def workload_reference(tmp_root, pipeline, *args):
    "The uninterrupted run of a workload, shared by the tests of one session."
    make = lambda d: run_workload(pipeline, d, os.path.join(d, "out.frk"), *args)  # noqa: E731
    return shared_run(tmp_root, run_name("wl-" + pipeline, args), make)[0]


def crash_and_rerun(tmp_path, pipeline, die, *args, rerun=("--load", "crash"), expect=0):
    "Kill a workload at `die` (stage,epoch,k), run the same script again; the rerun's result and output."
    run_workload(pipeline, tmp_path, tmp_path / "dead.frk", "--die", die, *args, expect=-signal.SIGKILL)
    log = run_workload(pipeline, tmp_path, tmp_path / "out.frk", *args, *rerun, expect=expect)
    return (fr.load(tmp_path / "out.frk") if expect == 0 else None), log


def assert_same_result(ref, res, keys=("model", "opt", "losses", "lrs", "values", "rng", "csv")):
    for key in keys:
        assert equal(ref[key], res[key]), f"{key} differs from the uninterrupted run"


@contextlib.contextmanager
def tmpfs(folder, size):
    """A real file system of `size` (mount's syntax: "11m") mounted on `folder` while inside; the test is
    skipped, saying why, only where mounting is impossible (not root, no CAP_SYS_ADMIN, no mount)."""
    os.makedirs(folder, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs on {folder}: {e}")
    if r.returncode:
        why = r.stderr.decode(errors="replace").strip()
        pytest.skip(f"cannot mount a tmpfs on {folder} (it needs root or CAP_SYS_ADMIN): {why}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
