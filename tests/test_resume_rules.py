"""When a fit resumes and how the caller overrides it; index-level skipping; the fastai resume
defects fixed on the way (#3780, #3844, fit_flat_cos ignoring start_epoch); the C state machine."""

import pytest
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.progress import ShowGraphCallback
from fastai.callback.tracker import SaveModelCallback
from trainer import build

from fastai_resume import _core

N_ITER = 46


class StopAt(Callback):
    "Saves a resumable checkpoint after k batches of epoch e and stops the fit (an in-process 'crash')."

    order = 100

    def __init__(self, e, k):
        self.at = (e, k)

    def after_batch(self):
        if self.training and (self.epoch, self.iter + 1) == self.at:
            self.learn.save("ck", with_iter=True)
            raise CancelFitException()


class CountItems:
    "Counts the items the training DataLoader actually loads."

    def __init__(self):
        self.n = 0

    def __call__(self, item):
        self.n += 1
        return item


def checkpoint(tmp_path, e=1, k=10, n_epoch=3):
    learn = build(tmp_path, noise=False)
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(n_epoch, 1e-2, cbs=StopAt(e, k))
    return learn


def fresh(tmp_path, **kw):
    learn = build(tmp_path, noise=False, **kw)
    learn.load("ck")
    return learn


def fit(learn, *a, **kw):
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(*a, **kw)
    return learn


def test_resumed_epoch_skips_on_the_index_list_without_loading_batches(tmp_path):
    checkpoint(tmp_path, e=2, k=40)
    learn = fresh(tmp_path)
    counter = CountItems()
    learn.dls.train.after_item = counter
    fit(learn, 3, 1e-2)
    # only the remaining items were ever loaded (fastai loads the dropped partial batch too)
    assert counter.n == 1500 - 40 * 32
    assert len(learn.recorder.losses) == 3 * N_ITER and len(learn.recorder.values) == 3


def test_explicit_start_epoch_and_start_iter_override_the_saved_position(tmp_path):
    checkpoint(tmp_path, e=1, k=10)
    learn = fit(fresh(tmp_path), 3, 1e-2, start_epoch=2)
    assert len(learn.recorder.losses) == N_ITER  # only epoch 2 trained
    learn = fit(fresh(tmp_path), 3, 1e-2, start_iter=30)
    assert len(learn.recorder.losses) == 3 * N_ITER - 2 * N_ITER - 30 + N_ITER  # epoch 1 from 30, epoch 2


def test_resume_false_runs_the_whole_fit(tmp_path):
    checkpoint(tmp_path)
    learn = fit(fresh(tmp_path), 3, 1e-2, resume=False)
    assert len(learn.recorder.losses) == 3 * N_ITER


def test_loading_arms_only_the_next_fit(tmp_path):
    checkpoint(tmp_path)
    learn = fit(fresh(tmp_path), 3, 1e-2)
    fit(learn, 1, 1e-3)
    assert len(learn.recorder.losses) == N_ITER


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_epoch=4), "n_epoch 3 -> 4"),
        (dict(bs=16), "batch size 32 -> 16"),
    ],
)
def test_a_different_fit_is_refused_unless_overridden(tmp_path, capsys, change, message):
    checkpoint(tmp_path)
    learn = fresh(tmp_path, bs=change.get("bs", 32))
    n = change.get("n_epoch", 3)
    with pytest.raises(ValueError, match=message):
        fit(learn, n, 1e-2)
    capsys.readouterr()
    fit(learn, n, 1e-2, start_epoch=1, start_iter=10)  # still armed; explicit: the caller decides
    assert "at epoch 1, iteration 10/" in capsys.readouterr().out


def test_save_model_callback_with_start_epoch_does_not_crash_fastai_3780(tmp_path):
    learn = build(tmp_path, noise=False)
    fit(learn, 3, 1e-2, start_epoch=2, cbs=SaveModelCallback(monitor="valid_loss"))
    assert len(learn.recorder.values) == 1 and (tmp_path / "models" / "model.pth").exists()


def test_show_graph_callback_with_skipped_epochs_fastai_3844(tmp_path):
    learn = build(tmp_path, noise=False)
    learn.fit_one_cycle(3, 1e-2, start_epoch=1, cbs=ShowGraphCallback())
    assert len(learn.recorder.values) == 2


def test_fit_flat_cos_honours_start_epoch(tmp_path):
    learn = build(tmp_path, noise=False)
    with learn.no_bar(), learn.no_logging():
        learn.fit_flat_cos(3, 1e-2, start_epoch=2)
    assert len(learn.recorder.losses) == N_ITER


def test_progress_bar_starts_at_the_resumed_batch(tmp_path):
    checkpoint(tmp_path, e=1, k=25)
    learn = fresh(tmp_path)
    seen = []

    class Peek(Callback):
        order = 300

        def before_batch(self):
            if self.training and not seen:
                seen.append((self.iter, self.learn.progress.pbar.last_v))

    learn.fit_one_cycle(3, 1e-2, cbs=Peek())
    assert seen == [(25, 25)]


def test_user_callback_state_hook(tmp_path):
    class Counter(Callback):
        order = 90

        def __init__(self):
            self.n = 0

        def after_batch(self):
            self.n += 1

        def resume_state(self):
            return {"n": self.n}

        def load_resume_state(self, st):
            self.n = st["n"]

    learn = build(tmp_path, noise=False, extra_cbs=[Counter()])
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(3, 1e-2, cbs=StopAt(1, 10))
    learn = fresh(tmp_path, extra_cbs=[Counter()])
    fit(learn, 3, 1e-2)
    assert learn.counter.n == 3 * N_ITER + 3 * 3  # every training batch and every validation batch


def test_skip_state_machine_directly():
    s = _core.SkipToIter()
    s.arm(2, 5, 4, 10)
    assert s.before_epoch(0) == (1, 0, 0) and s.before_epoch(1) == (1, 0, 0)
    assert s.before_epoch(2) == (2, 2, 5)  # resume at batch 5, epoch-start RNG now
    assert s.take_rng() is True and s.take_rng() is False
    s.after_epoch(2)
    assert not s.pending and s.before_epoch(3) == (0, 0, 0)
    s.arm(1, 0, 4, 10)
    assert s.before_epoch(1) == (2, 1, 0)  # at an epoch boundary: the saved RNG state at once
    assert not s.after_last_epoch()
    s.arm(4, 0, 4, 10)  # the fit's very end: no epoch resumes, the saved state is due after the last
    assert all(s.before_epoch(e) == (1, 0, 0) for e in range(4)) and s.take_rng() is False
    assert s.after_last_epoch() is True and s.after_last_epoch() is False and not s.pending
    with pytest.raises(ValueError, match="batch 11 of an epoch of 10"):
        s.arm(1, 11, 4, 10)
    assert _core.skip_plan(True, 2, 5, -1, -1) == (2, 5)
    assert _core.skip_plan(True, 2, 5, 3, -1) == (3, 0)
    assert _core.skip_plan(True, 2, 5, -1, 7) == (2, 7)
    assert _core.skip_plan(False, 0, 0, -1, -1) is None


def test_csv_logger_continues_its_file(tmp_path):
    from fastai.callback.progress import CSVLogger

    learn = build(tmp_path, noise=False, extra_cbs=[CSVLogger()])
    with learn.no_bar():
        learn.fit_one_cycle(3, 1e-2, cbs=StopAt(2, 10))
    before = (tmp_path / "history.csv").read_text().splitlines()
    learn = fresh(tmp_path, extra_cbs=[CSVLogger()])
    with learn.no_bar():
        learn.fit_one_cycle(3, 1e-2)
    after = (tmp_path / "history.csv").read_text().splitlines()
    assert len(before) == 3 and len(after) == 4 and after[:3] == before and after[3].startswith("2,")


def test_a_checkpoint_loaded_with_strict_false_into_a_model_with_more_state_resumes(tmp_path):
    """`learn.load(name, strict=False)` loads what the file has into a model that holds more (a buffer
    added since); the resumed fit, which puts the checkpoint's model back as it starts, puts back the
    same keys, and the added buffer keeps its value."""
    import torch

    learn = build(tmp_path)
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-3, cbs=StopAt(1, 10))
    fresh = build(tmp_path)
    fresh.model.register_buffer("extra", torch.full((3,), 7.0))
    fresh.load("ck", strict=False)
    with fresh.no_bar(), fresh.no_logging():
        fresh.fit(2, 1e-3)
    assert len(fresh.recorder.losses) == 2 * N_ITER and torch.equal(fresh.model.extra, torch.full((3,), 7.0))
