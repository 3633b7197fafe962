"""Learner.save / Learner.load on real fastai learners: the new format, vanilla .pth files, and
the rules of with_iter."""

import os
import sys

import numpy as np
import pytest
import torch
from procs import equal as tensors_equal
from trainer import build

import fastai_resume as fr


def trained(tmp_path, **kw):
    learn = build(tmp_path, **kw)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    return learn


@pytest.mark.parametrize("torch_opt", [False, True], ids=["fastai-Optimizer", "OptimWrapper"])
def test_round_trip_restores_model_and_optimizer_bitwise(tmp_path, torch_opt):
    learn = trained(tmp_path, torch_opt=torch_opt)
    path = learn.save("m", with_iter=True)
    assert path.suffix == ".frk" and fr.is_checkpoint(path)
    fresh = build(tmp_path, torch_opt=torch_opt)
    fresh.load("m")
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())
    assert tensors_equal(fr.state.plain(learn.opt.state_dict()), fr.state.plain(fresh.opt.state_dict()))
    # negative control: an untrained learner differs
    assert not tensors_equal(learn.model.state_dict(), build(tmp_path).model.state_dict())


def test_vanilla_fastai_pth_still_loads_exactly_as_fastai_loads_it(tmp_path):
    learn = trained(tmp_path)
    path = learn.save("plain")  # no with_iter: fastai's own format
    assert path.suffix == ".pth" and not fr.is_checkpoint(path)
    assert isinstance(torch.load(path, weights_only=False), dict)  # a plain torch.load user is not surprised
    fresh = build(tmp_path)
    fresh.load("plain")
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())
    assert fr.script.script(fresh).armed is None


def test_format_is_detected_by_magic_not_by_name(tmp_path):
    learn = trained(tmp_path)
    src = learn.save("m", with_iter=True)
    disguised = tmp_path / "models" / "disguised.pth"
    os.replace(src, disguised)
    fresh = build(tmp_path)
    fresh.load("disguised")
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())


def test_newest_of_name_frk_and_name_pth_is_loaded(tmp_path):
    learn = trained(tmp_path)
    learn.save("m")  # .pth
    w_pth = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    learn.save("m", with_iter=True)  # .frk, newer
    fresh = build(tmp_path)
    fresh.load("m")
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())
    assert not tensors_equal(w_pth, fresh.model.state_dict())


def test_with_iter_requires_with_opt(tmp_path):
    learn = trained(tmp_path)
    with pytest.raises(ValueError, match="with_iter=True\\) needs the optimizer state"):
        learn.save("m", with_iter=True, with_opt=False)


def test_save_outside_fit_carries_no_position(tmp_path):
    learn = trained(tmp_path)
    learn.save("m", with_iter=True)
    assert fr.load(tmp_path / "models" / "m.frk")["train"] is None
    fresh = build(tmp_path)
    fresh.load("m")
    assert fr.script.script(fresh).armed is None
    with fresh.no_bar(), fresh.no_logging():
        fresh.fit(1, 1e-3)
    assert len(fresh.recorder.losses) == len(fresh.dls.train)  # nothing skipped


def test_mismatched_learner_gives_a_clear_error_and_keeps_the_file(tmp_path):
    learn = trained(tmp_path)
    learn.save("m", with_iter=True)
    other = build(tmp_path)
    other.model = torch.nn.Sequential(torch.nn.Linear(64, 10))
    other.opt = None
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(fr.CheckpointError, match="does not fit this learner's model: .*shape"):
        other.load("m")
    assert fr.load(tmp_path / "models" / "m.frk")["model"]  # still there, intact
    assert tensors_equal(before, other.model.state_dict())  # and the learner untouched


def test_a_mismatched_optimizer_leaves_the_learners_weights_untouched(tmp_path):
    learn = trained(tmp_path)
    learn.save("m", with_iter=True)
    other = build(tmp_path)
    other.create_opt()
    other.opt.param_lists = other.opt.param_lists[0][:2], other.opt.param_lists[0][2:]  # two groups now
    other.opt.hypers = [dict(other.opt.hypers[0]), dict(other.opt.hypers[0])]
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(fr.CheckpointError, match="optimizer state does not fit"):
        other.load("m")
    assert tensors_equal(before, other.model.state_dict())
    assert not tensors_equal(before, learn.model.state_dict())  # the file's weights would differ


_PATCH_TWICE = """
import importlib, inspect, sys
import fastai_resume, fastai_resume.patches as P
from fastai.learner import Learner
assert "fastai.callback.schedule" not in sys.modules and "fastai.callback.progress" not in sys.modules
orig = Learner._orig_fit
importlib.reload(P)  # the patches applied a second time
import fastai.callback.schedule  # defines the fit wrappers: patched now
importlib.reload(P)
assert Learner._orig_fit is orig and orig.__module__ == "fastai.learner"
assert Learner._orig_fit_one_cycle.__module__ == "fastai.callback.schedule"
for name in ("fit", "fit_one_cycle", "fit_flat_cos", "fit_sgdr", "fine_tune"):
    ps = list(inspect.signature(getattr(Learner, name)).parameters)
    assert ps.count("start_iter") == 1 and ps.count("resume") == 1, (name, ps)
assert list(inspect.signature(Learner.fit).parameters)[:7] == ["self", "n_epoch", "lr", "wd", "cbs", "reset_opt", "start_epoch"]
print("ok")
"""


def test_import_patches_idempotently_lazily_and_keeps_signatures():
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-c", _PATCH_TWICE],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore"),
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_the_package_builds_as_a_wheel_with_extension_stub_and_marker(tmp_path):
    import subprocess
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), root],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    wheel = next(tmp_path.glob("fastai_resume-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("fastai_resume/_core") and n.endswith(".so") for n in names)
    assert "fastai_resume/_core.pyi" in names and "fastai_resume/py.typed" in names
    assert any(n.endswith("entry_points.txt") for n in names)


class _SaveAt(__import__("fastai.callback.core", fromlist=["Callback"]).Callback):
    order = 100

    def __init__(self, k):
        self.k = k

    def after_batch(self):
        if self.training and self.iter + 1 == self.k:
            self.learn.save("mid", with_iter=True)
            raise __import__("fastai.callback.core", fromlist=["x"]).CancelFitException()


def test_restored_losses_are_rebuilt_on_first_read_into_a_plain_list(tmp_path):
    from fastai.callback.core import Callback

    ref = trained(tmp_path)  # one uninterrupted epoch
    learn = build(tmp_path)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=_SaveAt(7))
    seen = {}

    class Probe(Callback):
        order = 1000

        def before_train(self):
            if seen:
                return
            rec = self.learn.recorder
            seen["pending_at_first_batch"] = rec.__dict__["losses"] == []  # nothing built yet
            seen["pickled"] = set(rec.__getstate__())  # what pickle (learn.export) would store
            self.learn.save("again", with_iter=True)  # a save in that window sees every loss
            seen["n_read"] = len(rec.losses)  # a read rebuilds the list

    fresh = build(tmp_path)
    fresh.load("mid")
    with fresh.no_bar(), fresh.no_logging():
        fresh.fit(1, 1e-3, cbs=Probe())
    assert seen["pending_at_first_batch"] and seen["n_read"] == 7
    assert "losses" not in seen["pickled"] and "_state" not in seen["pickled"]
    losses = fresh.recorder.losses
    assert type(losses) is list and all(isinstance(l, torch.Tensor) and l.dim() == 0 for l in losses)
    assert torch.equal(torch.stack(losses), torch.stack(ref.recorder.losses))
    saved = fr.load(tmp_path / "models" / "again.frk")["train"]["recorder"]["losses"]
    assert torch.equal(saved, torch.stack(ref.recorder.losses[:7]))
    fresh.recorder.losses = [torch.tensor(1.0)]  # plain assignment still works, pending or not
    assert len(fresh.recorder.losses) == 1


def test_the_recorders_history_is_converted_once_per_entry_and_always_equals_the_whole_list(tmp_path, monkeypatch):
    """A save converts only the lrs and losses appended since the Recorder's last save (a run of days
    otherwise paid for its whole history at every save); whatever happens to the lists, what is
    saved equals converting them whole, and a save/load round trip gives back the same floats."""
    from fastai_resume import state

    learn = trained(tmp_path)
    rec = learn.recorder
    converted = []
    for name in ("_stack_losses", "_float_tensor"):
        real = getattr(state, name)
        monkeypatch.setattr(state, name, lambda items, real=real: converted.append(len(items)) or real(items))

    def check(n_converted):
        converted.clear()
        st = state.recorder_state(rec)
        assert converted == n_converted
        assert st["lrs"].dtype == torch.float64 and st["lrs"].tolist() == rec.lrs
        assert all(type(x) is float for x in st["lrs"].tolist())
        assert torch.equal(st["losses"], torch.stack(rec.losses))

    n = len(rec.lrs)
    check([n, n])  # the first save converts the whole history
    check([])  # nothing new: nothing converted
    rec.losses.append(torch.tensor(0.25))
    rec.lrs += [1e-3, 2e-3]
    check([1, 2])  # only the tail
    rec.losses[3] = torch.tensor(9.0)  # an entry replaced: the whole list again
    rec.lrs.pop(5)  # one removed
    check([n + 1, n + 1])
    rec.lrs.insert(0, 0.5)
    rec.losses = list(rec.losses)  # a new list of the same objects: the same values, nothing to convert
    check([n + 2])
    rec.losses = [x.clone() for x in rec.losses]  # new objects: all converted again
    check([n + 1])
    rec.lrs.append(np.float32(0.1))  # an entry that is not a float: saved as a list, as before
    st = state.recorder_state(rec)
    assert isinstance(st["lrs"], list) and st["lrs"][-1] == np.float32(0.1).item()
    # saved mid-fit, resumed: the same floats back in the Recorder
    mid = build(tmp_path)
    with mid.no_bar(), mid.no_logging():
        mid.fit(1, 1e-3, cbs=_SaveAt(7))
    tree = fr.load(tmp_path / "models" / "mid.frk")
    assert tree["fastai_resume"] >= 3 and tree["train"]["recorder"]["lrs"].dtype == torch.float64
    fresh = build(tmp_path)
    fresh.load("mid")
    with fresh.no_bar(), fresh.no_logging():
        fresh.fit(1, 1e-3)
    ref = trained(tmp_path)  # the uninterrupted epoch
    assert fresh.recorder.lrs == ref.recorder.lrs and all(type(x) is float for x in fresh.recorder.lrs)
    assert torch.equal(torch.stack(fresh.recorder.losses), torch.stack(ref.recorder.losses))
    # a file of schema 2 (the previous release: lrs as a list of floats) resumes the same way
    tree["fastai_resume"], tree["train"]["recorder"]["lrs"] = 2, tree["train"]["recorder"]["lrs"].tolist()
    fr.save(tree, tmp_path / "models" / "old.frk")
    old = build(tmp_path)
    old.load("old")
    with old.no_bar(), old.no_logging():
        old.fit(1, 1e-3)
    assert old.recorder.lrs == ref.recorder.lrs
    assert tensors_equal(old.model.state_dict(), ref.model.state_dict())


def test_a_vanilla_pth_renamed_frk_loads_by_its_magic_bytes(tmp_path):
    learn = trained(tmp_path)
    learn.save("plain")  # fastai's own .pth
    os.replace(tmp_path / "models" / "plain.pth", tmp_path / "models" / "x.frk")
    fresh = build(tmp_path)
    fresh.load("x")
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())


def _in_fit_checkpoint(tmp_path, name="m"):
    "A checkpoint saved mid-fit (it holds a position), and the learner that saved it."
    from fastai.callback.core import Callback, CancelFitException

    class SaveMidFit(Callback):
        order = 100

        def after_batch(self):
            if self.training and self.iter == 4:
                self.learn.save(name, with_iter=True)
                raise CancelFitException()

    learn = build(tmp_path)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=SaveMidFit())
    return learn


def test_a_subclass_whose_own_load_reads_the_file_itself_never_gets_our_file_and_is_warned(tmp_path):
    """A Learner subclass (like fastai's TextLearner) with its own `load` that opens the file with a pickle
    load: our checkpoint is loaded by fastai_resume (validated, the resume armed), with a warning naming
    the class; a `.pth` file still goes to the subclass's own method."""
    from fastai.learner import Learner

    opened = []

    class PickleLoader(Learner):
        def load(self, file, with_opt=None, device=None, **kwargs):
            opened.append(file)
            state = torch.load(self.path / self.model_dir / f"{file}.pth", weights_only=False)
            self.model.load_state_dict(state["model"])
            return self

    learn = _in_fit_checkpoint(tmp_path)
    fresh = build(tmp_path)
    fresh.__class__ = PickleLoader
    with pytest.warns(UserWarning, match="PickleLoader.load is its own and does not call Learner.load"):
        fresh.load("m")
    assert opened == [] and fr.script.script(fresh).armed is not None
    assert tensors_equal(learn.model.state_dict(), fresh.model.state_dict())
    learn.save("plain")
    fresh.load("plain")
    assert opened == ["plain"]


def test_a_subclass_whose_load_calls_super_gets_the_resume_arguments_through(tmp_path):
    from fastai.learner import Learner

    class Polite(Learner):
        def load(self, file, with_opt=None):  # passes neither resume nor fast_forward on
            return super().load(file, with_opt=with_opt)

    _in_fit_checkpoint(tmp_path)
    fresh = build(tmp_path)
    fresh.__class__ = Polite
    fresh.load("m", resume=False)
    assert fr.script.script(fresh).armed is None
    fresh.load("m")
    assert fr.script.script(fresh).armed is not None


def test_a_subclass_save_that_drops_with_iter_is_refused_loudly(tmp_path):
    from fastai.callback.core import Callback, CancelFitException
    from fastai.learner import Learner

    class Dropper(Learner):
        def save(self, file, **kwargs):
            return super().save(file)  # with_iter never reaches Learner.save

    learn = build(tmp_path)
    learn.__class__ = Dropper
    errors = []

    class SaveMidFit(Callback):
        order = 100

        def after_batch(self):
            if self.training and self.iter == 2:
                try:
                    self.learn.save("d", with_iter=True)
                except fr.CheckpointError as e:
                    errors.append(str(e))
                raise CancelFitException()

    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=SaveMidFit())
    assert errors and "Dropper.save did not pass with_iter=True on to Learner.save" in errors[0]
    assert not (tmp_path / "models" / "d.frk").exists()


_DDL = """
import sys
first, then = sys.argv[1:]
__import__(first); __import__(then)
import torch
from fastai.distributed import DistributedDL
from fastai.data.load import DataLoader
dl = DistributedDL(DataLoader(list(range(10)), bs=4, shuffle=True), rank=0, world_size=1)
print(DistributedDL._broadcast.__name__, sum(len(b) for b in dl))
"""


@pytest.mark.parametrize("first", ["fastai_resume", "fastai.distributed"])
def test_distributed_dl_stays_on_the_cpu_whichever_is_imported_first(first):
    "fastai's `DistributedDL` moves its index list to CUDA; patched as `fastai.distributed` is imported, in either order."
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    other = "fastai.distributed" if first == "fastai_resume" else "fastai_resume"
    p = subprocess.run([sys.executable, "-c", _DDL, first, other], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and p.stdout.split() == ["_broadcast_idxs", "10"], p.stdout + p.stderr
    # fastai's own, without the package: the negative control
    p = subprocess.run(
        [sys.executable, "-c", _DDL, "fastai.distributed", "fastai.learner"], capture_output=True, text=True, env=env
    )
    assert p.returncode != 0 and "cuda" in p.stderr.lower(), p.stdout + p.stderr
