"""Exactness: a run that saves at iteration k of epoch e, dies by SIGKILL and is restarted in a
new process that builds the learner the same way, loads and fits again, ends bitwise equal to the
uninterrupted run: model, optimizer, and the Recorder's losses, lrs and metric values."""

import pytest
from procs import N_ITER, assert_same_run, equal, reference, run

import fastai_resume as fr


def crash_and_resume(tmp_path, die_at, *args, resume_args=()):
    out = run(tmp_path, tmp_path / "dead.frk", "--die-at", die_at, *args, expect_kill=True)
    assert (tmp_path / "models" / "crash.frk").exists() and not (tmp_path / "dead.frk").exists()
    log = run(tmp_path, tmp_path / "out.frk", "--resume", "crash", *args, *resume_args)
    return fr.load(tmp_path / "out.frk"), out, log


@pytest.mark.parametrize("epoch", [0, 1, 2], ids=["first-epoch", "middle-epoch", "last-epoch"])
@pytest.mark.parametrize("k", [1, 23, N_ITER], ids=["first-batch", "middle-batch", "last-batch"])
def test_kill_at_iteration_k_then_resume_is_bitwise_equal(tmp_root, tmp_path, epoch, k):
    ref = reference(tmp_root)
    res, _, log = crash_and_resume(tmp_path, f"{epoch},{k}")
    assert f"at epoch {epoch}, iteration {k}/{N_ITER}" in log
    assert_same_run(ref, res)


def test_negative_control_without_the_data_order_state_the_run_differs(tmp_root, tmp_path):
    ref = reference(tmp_root)
    res, _, _ = crash_and_resume(tmp_path, "1,20", resume_args=("--break-data-order",))
    assert not equal(ref["model"], res["model"])
    assert not equal(ref["losses"], res["losses"])


@pytest.mark.slow
def test_gradient_accumulation_mid_accumulation(tmp_root, tmp_path):
    ref = reference(tmp_root, "--grad-acc", "96")  # a step every 3 batches; k=7 is mid-accumulation
    res, _, _ = crash_and_resume(tmp_path, "1,7", "--grad-acc", "96")
    assert_same_run(ref, res)


@pytest.mark.slow
def test_two_dataloader_workers_same_data_order(tmp_root, tmp_path):
    # The noise augmentation runs in the workers, whose RNG is reseeded each epoch: without it,
    # data order is the only randomness in the data and the run is exact.
    ref = reference(tmp_root, "--workers", "2", "--no-noise")
    res, _, _ = crash_and_resume(tmp_path, "1,17", "--workers", "2", "--no-noise")
    assert_same_run(ref, res)


def test_save_model_and_early_stopping_callbacks(tmp_root, tmp_path):
    ref = reference(tmp_root, "--trackers")
    res, _, _ = crash_and_resume(tmp_path, "2,10", "--trackers")
    assert_same_run(ref, res)


def test_save_from_after_epoch(tmp_root, tmp_path):
    ref = reference(tmp_root)
    res, _, log = crash_and_resume(tmp_path, "0,0", "--die-event", "after_epoch")
    assert "at epoch 1, iteration 0/46" in log
    assert log.count("[0, ") == 1  # the finished epoch's row is printed from the checkpoint
    assert_same_run(ref, res)


@pytest.mark.parametrize("method", ["fit_flat_cos", "fine_tune"])
def test_fit_wrappers_resume(tmp_root, tmp_path, method):
    ref = reference(tmp_root, "--method", method)
    res, _, _ = crash_and_resume(tmp_path, "1,13", "--method", method)
    assert_same_run(ref, res)


@pytest.mark.slow
def test_torch_optimizer_through_optim_wrapper(tmp_root, tmp_path):
    ref = reference(tmp_root, "--torch-opt")
    res, _, _ = crash_and_resume(tmp_path, "1,30", "--torch-opt")
    assert_same_run(ref, res)
