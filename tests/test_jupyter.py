"""Resume the way people run fastai: the README's quick start verbatim with fastai's default relative
paths from a fresh working directory, relative and elsewhere model folders, and a real Jupyter kernel
(jupyter_client + ipykernel) killed and restarted, or interrupted and the fit cell run again."""

import os
import queue
import signal
import subprocess
import sys
import time

import pytest
from fastai.callback.core import Callback
from procs import ENV, HERE, equal, shared_run
from test_resume_rules import fit
from trainer import build, result

import fastai_resume as fr

ROOT = os.path.dirname(HERE)

# What a user's notebook or script has before the quick start: data with fastai's default path ('.').
PREFIX = """
import os, sys, time, torch
sys.path.insert(0, {root!r})
from torch import nn
from fastai.basics import *
{extra_import}from sklearn.datasets import load_digits
set_seed(42)
X, y = load_digits(return_X_y=True)
items = list(zip(torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)))
items = [(x, int(t)) for x, t in items]
class Noisy(ItemTransform):
    def encodes(self, o):
        time.sleep(float(os.environ.get("ITEM_SLEEP", "0")))
        return o[0] + 0.05 * torch.randn(64)
dls = DataBlock(blocks=(TransformBlock, CategoryBlock), get_x=Noisy(), get_y=ItemGetter(1),
                splitter=IndexSplitter(range(1500, 1797))).dataloaders(items, bs=32, num_workers=0, device="cpu"{dls_kw})
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))
"""
QUICK_START = """
import fastai_resume                                  # patches Learner.save / load / fit
from fastai_resume import AutoCheckpoint

learn = Learner(dls, model, metrics=accuracy{learner_kw},
                cbs=AutoCheckpoint(every_iters=500, keep=3))   # background saves, newest 3 kept
learn.fit_one_cycle(4, 1e-3)
"""
SUFFIX = """
fastai_resume.save({{"model": learn.model.state_dict(), "opt": fastai_resume.state.plain(learn.opt.state_dict()),
                    "losses": [float(l) for l in learn.recorder.losses], "values": [[float(v) for v in r] for r in learn.recorder.values],
                    "rng": torch.rand(3)}}, {out!r})
"""


def script(tmp_path, out, dls_kw="", learner_kw=""):
    extra = "from fastai.callback.schedule import *  # fit_one_cycle (fastai.vision.all and friends import it)\n"
    return (
        PREFIX.format(root=ROOT, dls_kw=dls_kw, extra_import=extra)
        + QUICK_START.format(learner_kw=learner_kw)
        + SUFFIX.format(out=str(out))
    )


def run_killed(cwd, code, folder, epoch=2):
    "Run `code` in `cwd` until the checkpoint of `epoch`'s start is in `folder`, then SIGKILL it mid-epoch."
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=dict(ENV, ITEM_SLEEP="0.0007"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    while not list(folder.glob(f"auto-*-e{epoch:06d}-i0000000000.frk")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # now in the middle of that epoch
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-epoch"


def run(cwd, code):
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.parametrize(
    "dls_kw, learner_kw, folder",
    [
        ("", "", "models"),  # fastai's defaults: path '.', model_dir 'models'
        (", path='runs/exp'", ", model_dir='ckpt'", "runs/exp/ckpt"),
        ("", ", model_dir={elsewhere!r}", None),
    ],
    ids=["default-paths", "relative-path-and-model-dir", "absolute-model-dir-elsewhere"],
)
def test_readme_quick_start_killed_mid_epoch_and_run_again_is_exact(tmp_root, tmp_path, dls_kw, learner_kw, folder):
    "The folders change where checkpoints go, never what is trained: one uninterrupted run is every case's reference."
    elsewhere = tmp_path / "elsewhere"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (ref,) = shared_run(tmp_root, "quick-start", lambda d: run(d, script(tmp_path, os.path.join(d, "out.frk"))))
    code = script(tmp_path, run_dir / "out.frk", dls_kw, learner_kw.format(elsewhere=str(elsewhere)))
    where = run_dir / folder if folder else elsewhere  # where fastai's path rules put them
    run_killed(run_dir, code, where)
    log = run(run_dir, code)
    assert "AutoCheckpoint: found" in log and "fastai_resume: resuming" in log and "at epoch 2, iteration 0/" in log
    res = fr.load(run_dir / "out.frk")
    for k in ref:
        assert equal(ref[k], res[k]), f"{k} differs from the uninterrupted run"


class InterruptAt(Callback):
    "Ctrl-C (Jupyter's Interrupt) arriving at `event` of training batch `it` of epoch 1."

    def __init__(self, event, it):
        self.it = it
        setattr(self, event, self._fire)

    def _fire(self):
        if self.training and self.epoch == 1 and self.iter == self.it:
            raise KeyboardInterrupt


@pytest.mark.parametrize("event", ["after_pred", "after_backward", "before_step", "after_step", "after_batch"])
def test_an_interrupt_at_any_point_of_a_batch_then_the_fit_again_is_exact(tmp_path, event):
    "Between `backward` and `zero_grad` the interrupted process holds gradients a fresh process has not."
    ref = build(tmp_path / "ref", extra_cbs=[fr.AutoCheckpoint(every_iters=10)])
    fit(ref, 2, 1e-2)
    learn = build(tmp_path / "run", extra_cbs=[fr.AutoCheckpoint(every_iters=10)])
    with pytest.raises(KeyboardInterrupt):
        fit(learn, 2, 1e-2, cbs=InterruptAt(event, 13))
    fit(learn, 2, 1e-2)  # the cell run again: resumes from the checkpoint of iteration 10
    want, got = result(ref), result(learn)
    for key in ("model", "opt", "losses", "values"):
        assert equal(want[key], got[key]), f"{key} differs from the uninterrupted run"
    assert len(got["losses"]) == 2 * len(ref.dls.train)


def test_interrupts_again_and_again_also_in_the_resumed_fit_with_worker_processes_stay_exact(tmp_path):
    "Four interrupts, two of them in fits that had just resumed (one at its first batch), items drawn in 2 workers."
    ref = build(tmp_path / "ref", nw=2, extra_cbs=[fr.AutoCheckpoint(every_iters=10)])
    fit(ref, 2, 1e-2)
    learn = build(tmp_path / "run", nw=2, extra_cbs=[fr.AutoCheckpoint(every_iters=10)])
    for event, it in (("after_backward", 13), ("before_batch", 4), ("after_step", 5), ("after_backward", 30)):
        with pytest.raises(KeyboardInterrupt):
            fit(learn, 2, 1e-2, cbs=InterruptAt(event, it))
    fit(learn, 2, 1e-2)
    want, got = result(ref), result(learn)
    for key in ("model", "opt", "losses", "values"):
        assert equal(want[key], got[key]), f"{key} differs from the uninterrupted run"


# ---- a real Jupyter kernel ------------------------------------------------------------------------

jupyter_client = pytest.importorskip("jupyter_client")


class Kernel:
    "A real IPython kernel in `cwd`, driven as a notebook front end drives it."

    def __init__(self, cwd):
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.kernel_spec_manager.ensure_native_kernel = True
        self.km.start_kernel(
            cwd=str(cwd), env=dict(ENV, ITEM_SLEEP="0.0007"), extra_arguments=["--HistoryManager.enabled=False"]
        )
        self.connect()

    def connect(self):
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code, timeout=600, until=None, then=None):
        "Execute a cell; returns its text output and status. `until`: call `then()` once output holds it."
        msg_id = self.kc.execute(code)
        out, fired, deadline = [], False, time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            c, t = msg["content"], msg["msg_type"]
            if t == "stream":
                out.append(c["text"])
            elif t == "error":
                out.append(f"{c['ename']}: {c['evalue']}\n")
            elif t in ("execute_result", "display_data"):
                out.append(c["data"].get("text/plain", "") + "\n")
            elif t == "status" and c["execution_state"] == "idle":
                return "".join(out)
            if until is not None and not fired and until in "".join(out):
                fired = True
                if then() == "dead":
                    return "".join(out)
        raise AssertionError("cell timed out: " + "".join(out))

    def stop(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def cells(out, with_import=True, auto=True):
    prefix = PREFIX.format(root=ROOT, dls_kw="", extra_import="")
    imp = "import fastai_resume\nfrom fastai_resume import AutoCheckpoint\n" if with_import else ""
    cbs = "cbs=AutoCheckpoint(every_iters=20, keep=3)" if auto else "cbs=[]"
    return [
        prefix,
        imp + f"learn = Learner(dls, model, metrics=accuracy, {cbs})",
        "learn.fit(4, 1e-3)",
        SUFFIX.format(out=str(out)) if with_import else "",
    ]


@pytest.fixture(scope="module")
def kernel_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("kref")
    k = Kernel(d)
    try:
        outs = [k.run(c) for c in cells(d / "out.frk")]
    finally:
        k.stop()
    return fr.load(d / "out.frk"), outs


def _rows(text):
    return [line.rsplit(",", 1)[0] for line in text.splitlines() if line.startswith("[")]


@pytest.mark.slow
def test_kernel_killed_mid_fit_restarted_and_run_all_again_is_exact(kernel_reference, tmp_path):
    ref, _ = kernel_reference
    k = Kernel(tmp_path)
    try:
        cs = cells(tmp_path / "out.frk")
        for c in cs[:2]:
            k.run(c)

        def crash():
            time.sleep(0.3)
            k.km.signal_kernel(signal.SIGKILL)  # the kernel dies mid-epoch, as in a crash
            return "dead"

        k.run(cs[2], until="[1,", then=crash)
        k.stop()
        k = Kernel(tmp_path)  # the notebook's kernel restarted: a new process, the same folder
        outs = [k.run(c) for c in cs]  # Run All
    finally:
        k.stop()
    assert "AutoCheckpoint: found" in outs[2]
    res = fr.load(tmp_path / "out.frk")
    for key in ref:
        assert equal(ref[key], res[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.slow
def test_kernel_interrupt_then_running_the_fit_cell_again_continues_exactly(kernel_reference, tmp_path):
    ref, _ = kernel_reference
    k = Kernel(tmp_path)
    try:
        cs = cells(tmp_path / "out.frk")
        for c in cs[:2]:
            k.run(c)
        out = k.run(cs[2], until="[1,", then=lambda: (time.sleep(0.3), k.km.interrupt_kernel()))
        assert "KeyboardInterrupt" in out
        again = k.run(cs[2])  # the user runs the fit cell again
        k.run(cs[3])
        export = k.run("learn.export('exported.pkl'); print('exported')")
    finally:
        k.stop()
    assert "AutoCheckpoint: found" in again and "fastai_resume: resuming" in again
    assert "exported" in export
    res = fr.load(tmp_path / "out.frk")
    for key in ref:
        assert equal(ref[key], res[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.slow
def test_kernel_interrupt_without_checkpoints_says_it_starts_the_stage_again(tmp_path):
    k = Kernel(tmp_path)
    try:
        cs = cells(tmp_path / "out.frk", auto=False)
        for c in cs[:2]:
            k.run(c)
        k.run(cs[2], until="[1,", then=lambda: (time.sleep(0.2), k.km.interrupt_kernel()))
        again = k.run(cs[2])
    finally:
        k.stop()
    assert "was interrupted at epoch " in again and "not an exact continuation" in again


@pytest.mark.slow
def test_kernel_cell_outputs_are_the_same_without_and_with_the_import(tmp_path):
    outs = {}
    for with_import in (False, True):
        d = tmp_path / str(with_import)
        d.mkdir()
        k = Kernel(d)
        try:
            outs[with_import] = [_rows(k.run(c)) for c in cells(d / "out.frk", with_import, auto=False)[:3]]
        finally:
            k.stop()
    assert outs[True] == outs[False] and len(outs[True][2]) == 4
