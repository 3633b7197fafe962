"""A good fastai citizen: importing the package changes nothing a user did not opt into, `save`/`load`
accept what fastai's accept, and `export` works at any time."""

import io as _io
import os
import subprocess
import sys

import pytest
import torch
from fastai.callback.core import Callback
from fastai.learner import load_learner
from procs import ENV, HERE
from test_resume_rules import StopAt, fit
from trainer import build

import fastai_resume as fr

SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from torch import nn
from fastai.basics import *
{imp}
from sklearn.datasets import load_digits
set_seed(1)
X, y = load_digits(return_X_y=True)
items = list(zip(torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)))
dls = DataLoaders(DataLoader(items[:600], bs=64, shuffle=True), DataLoader(items[1500:], bs=128), device="cpu")
learn = Learner(dls, nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), loss_func=CrossEntropyLossFlat(),
                metrics=accuracy)
print(sorted(type(c).__name__ for c in learn.cbs))
learn.fit(2, 1e-3)
print(sorted(m for m in sys.modules if m.startswith("fastai.callback")))
"""


def _run(imp):
    code = SCRIPT.format(root=os.path.dirname(HERE), imp=imp)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr
    return [line.rsplit(",", 1)[0] for line in p.stdout.splitlines()]  # without the time column


def test_a_fastai_basics_script_prints_the_same_without_and_with_the_import():
    plain, patched = _run(""), _run("import fastai_resume")
    assert plain == patched
    assert len([line for line in plain if line.startswith(("[0,", "[1,", "0 ", "1 "))]) == 2


def test_save_and_load_accept_a_buffer_as_fastai_does(tmp_path):
    learn = build(tmp_path, noise=False)
    fit(learn, 1, 1e-2)
    buf = _io.BytesIO()
    learn.save(buf)
    buf.seek(0)
    other = build(tmp_path, noise=False)
    other.load(buf)
    assert all(torch.equal(a, b) for a, b in zip(learn.model.state_dict().values(), other.model.state_dict().values()))
    with pytest.raises(TypeError, match="not a buffer"):
        learn.save(_io.BytesIO(), with_iter=True)


class ExportAtEnd(Callback):
    order = 500

    def after_fit(self):
        self.learn.export("during.pkl")


class Interrupt(Callback):
    def after_batch(self):
        if self.training and self.epoch == 1 and self.iter == 5:
            raise KeyboardInterrupt


def exportable(path, cbs=()):
    "A learner fastai itself can export (its data from a DataBlock, not plain lists)."
    from fastai.data.block import CategoryBlock, DataBlock, TransformBlock
    from fastai.data.transforms import IndexSplitter, ItemGetter
    from fastai.learner import Learner
    from sklearn.datasets import load_digits
    from torch import nn

    X, y = load_digits(return_X_y=True)
    items = list(zip(torch.tensor(X / 16.0, dtype=torch.float32), y.tolist()))[:600]
    dls = DataBlock(
        blocks=(TransformBlock, CategoryBlock),
        get_x=ItemGetter(0),
        get_y=ItemGetter(1),
        splitter=IndexSplitter(range(500, 600)),
    ).dataloaders(items, bs=32, device="cpu", path=path)
    return Learner(dls, nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), cbs=list(cbs), path=path)


def test_export_works_during_a_fit_and_after_an_interrupted_one_and_carries_nothing_of_ours(tmp_path):
    learn = exportable(tmp_path, [fr.AutoCheckpoint(every_iters=10)])
    fit(learn, 2, 1e-2, cbs=ExportAtEnd())
    with pytest.raises(KeyboardInterrupt):
        fit(learn, 3, 1e-2, cbs=Interrupt())
    learn.export("after.pkl")
    for name in ("during.pkl", "after.pkl"):
        exported = load_learner(tmp_path / name)
        assert not any(isinstance(c, fr.ResumeSession) for c in exported.cbs)
    assert learn.opt is not None and len(learn.dls.train) > 0  # the learner still trains
    assert not any(isinstance(c, fr.ResumeSession) for c in learn.cbs) and fr.script.script(learn).session is None


def test_a_learner_exported_with_autocheckpoint_trains_a_run_of_its_own_once_loaded(tmp_path, capsys):
    """fastai's export-then-reuse: the exported AutoCheckpoint keeps its settings, not the run that exported
    it (nor the remote's credentials); loaded and trained by another script in the same folder, it starts a
    new run instead of taking the exporter's checkpoints for its own (it refused the script as changed)."""
    ac = fr.AutoCheckpoint(every_iters=10, remote_options={"key": "k", "secret": "s"})
    learn = exportable(tmp_path, [ac])
    fit(learn, 2, 1e-2)
    old = {p.name for p in (tmp_path / "models").glob("auto-*.frk")}
    assert old and ac.run_id is not None
    learn.export("e.pkl")
    assert ac.run_id is not None and ac.remote_options  # the exporter's own callback is untouched
    loaded = load_learner(tmp_path / "e.pkl")
    got = next(c for c in loaded.cbs if isinstance(c, fr.AutoCheckpoint))
    assert (got.every_iters, got.keep, got.run_id, got.saved, got.remote_options) == (10, 3, None, [], None)
    loaded.dls = learn.dls
    capsys.readouterr()
    fit(loaded, 1, 1e-3)
    assert "found auto-" not in capsys.readouterr().out and len(loaded.recorder.values) == 1
    new = {p.name for p in (tmp_path / "models").glob("auto-*.frk")} - old
    assert new and got.run_id != ac.run_id and all(got.run_id in n for n in new)


def test_a_learner_exported_after_loading_a_mid_fit_checkpoint_is_not_armed(tmp_path):
    learn = exportable(tmp_path)
    fit(learn, 3, 1e-2, cbs=StopAt(1, 10))
    fresh = exportable(tmp_path)
    fresh.load("ck")
    fresh.export("armed.pkl")
    loaded = load_learner(tmp_path / "armed.pkl")
    assert fr.script.script(loaded).armed is None and fr.script.script(fresh).armed is not None
