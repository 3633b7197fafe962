"""Exact, or loud, on every data pipeline fastai users train with: each workload (tests/workloads.py)
is killed by SIGKILL mid-epoch after a save, run again in a new process with `learn.load`, and must
end bitwise equal to its uninterrupted run (model, optimizer, Recorder, the next draw of every RNG);
a stream that cannot be resumed exactly is refused with what to do."""

import pytest
from procs import assert_same_result, crash_and_rerun, equal, run_workload, workload_reference

import fastai_resume as fr


def test_language_model_on_a_shuffled_lm_dataloader_resumes_exactly_after_the_first_epoch(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "lm")
    res, log = crash_and_rerun(tmp_path, "lm", "0,1,5")
    assert "at epoch 1, iteration 5/" in log
    assert_same_result(ref, res)


def test_negative_control_lm_without_its_saved_document_order_differs(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "lm")
    res, _ = crash_and_rerun(tmp_path, "lm", "0,1,5", rerun=("--load", "crash", "--break-order"))
    assert not equal(ref["losses"], res["losses"]) and not equal(ref["model"], res["model"])


def test_plain_pytorch_dataloaders_resume_exactly(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "torch")
    res, log = crash_and_rerun(tmp_path, "torch", "0,1,7")
    assert "batch sampler" in log
    assert_same_result(ref, res)


@pytest.mark.slow
def test_datablock_vision_with_workers_random_item_and_batch_transforms_resumes_exactly(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "vision")
    res, _ = crash_and_rerun(tmp_path, "vision", "0,1,6")
    assert_same_result(ref, res)


def test_stream_with_state_dict_continues_from_its_state(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "stream")
    res, log = crash_and_rerun(tmp_path, "stream", "0,1,5")
    assert "stream state" in log
    assert_same_result(ref, res)


def test_a_fastai_stream_of_n_items_per_epoch_continues_and_trains_only_the_epochs_remaining_batches(
    tmp_root, tmp_path
):
    ref = workload_reference(tmp_root, "stream-fastai")
    res, log = crash_and_rerun(tmp_path, "stream-fastai", "0,1,5")
    assert "stream state, remaining batches" in log
    assert_same_result(ref, res)


def test_sorted_dl_whose_shuffle_returns_an_iterator_resumes_exactly(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "sorted")
    res, log = crash_and_rerun(tmp_path, "sorted", "0,1,6")
    assert "iteration 6/" in log and "index list" in log
    assert_same_result(ref, res)


def test_stream_without_state_is_refused_with_the_options(tmp_path):
    _, log = crash_and_rerun(tmp_path, "stream-nostate", "0,1,5", expect=1)
    assert "state_dict()/load_state_dict()" in log and "fast_forward=True" in log and "start_iter=0" in log


def test_stream_without_state_fast_forwards_when_asked(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "stream-nostate")
    res, log = crash_and_rerun(tmp_path, "stream-nostate", "0,1,5", rerun=("--load", "crash", "--fast-forward"))
    assert "fast-forward 5/5" in log
    assert_same_result(ref, res)


def test_train_metrics_accumulators_are_saved(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "digits", "--train-metrics")
    res, _ = crash_and_rerun(tmp_path, "digits", "0,1,7", "--train-metrics")
    assert_same_result(ref, res)


@pytest.mark.parametrize("order", [0, 55])
def test_a_save_from_a_callback_before_the_recorder_is_exact(tmp_root, tmp_path, order):
    ref = workload_reference(tmp_root, "digits")
    res, _ = crash_and_rerun(tmp_path, "digits", "0,1,7", "--die-order", str(order))
    assert_same_result(ref, res)


@pytest.mark.parametrize("event", ["after_epoch", "valid"])
def test_a_save_from_after_epoch_or_a_validation_batch_by_a_default_order_callback_is_exact(tmp_root, tmp_path, event):
    ref = workload_reference(tmp_root, "digits")  # (the model has dropout: the RNG state matters)
    res, _ = crash_and_rerun(tmp_path, "digits", "0,1,2", "--die-order", "0", "--die-event", event)
    assert_same_result(ref, res)


@pytest.mark.parametrize("pipeline", ["book-rnn3", "book-rnn7"])
def test_the_books_recurrent_models_whose_hidden_state_is_an_attribute_resume_exactly(tmp_root, tmp_path, pipeline):
    """The fastai book's chapter 12 language models as written there (`LMModel3`: `self.h`, an int 0 until the
    first batch makes it a tensor; `LMModel7`: an LSTM with a list of two tensors reset in place; both with
    `ModelResetter`, on `group_chunks`ed data in order): their hidden state lives in a plain attribute
    between batches, outside the state dict. Killed mid-epoch and resumed: exact."""
    ref = workload_reference(tmp_root, pipeline)
    res, log = crash_and_rerun(tmp_path, pipeline, "0,1,9")
    assert "resuming" in log
    assert_same_result(ref, res)


def test_a_hidden_state_that_goes_on_across_stages_is_restored_with_the_skipped_stage(tmp_root, tmp_path):
    """The book's LMModel3 without `reset` and without ModelResetter: its `h` goes on from one stage to the
    next (fastai resets a model only through its `reset`). Killed in stage 1 before its first checkpoint and run
    again with AutoCheckpoint, the rerun passes stage 0 and starts stage 1 from the hidden state stage 0 ended
    with (its end state holds it), as the uninterrupted run did."""
    args = ("--recipe", "stages", "--no-resetter", "--auto", "4")
    ref = workload_reference(tmp_root, "book-rnn3", *args)
    res, log = crash_and_rerun(tmp_path, "book-rnn3", "1,0,2", *args, rerun=())
    assert "AutoCheckpoint: found" in log and "e000002-i0000000000" in log  # stage 0's last: resumed at its end
    assert_same_result(ref, res)


@pytest.mark.parametrize("pipeline, die", [("weighted", "0,1,6"), ("partial", "0,2,5")])
def test_weighted_and_partial_dataloaders_whose_order_numpy_draws_resume_exactly(tmp_root, tmp_path, pipeline, die):
    """fastai's `weighted_dataloaders` (WeightedDL: each epoch's order drawn with replacement by NumPy's global
    RNG, by weight) and `partial_dataloaders` (PartialDL: a random subset each epoch), killed mid-epoch and
    resumed: the resumed epoch draws the same order, cut where it stopped."""
    ref = workload_reference(tmp_root, pipeline)
    res, log = crash_and_rerun(tmp_path, pipeline, die)
    assert "resuming" in log
    assert_same_result(ref, res)
    # the control: the same resume with the RNG of the save's moment in place of the epoch's start draws
    # another order for the resumed epoch, and the run differs
    run_workload(pipeline, tmp_path, tmp_path / "bad.frk", "--load", "crash", "--break-epoch-rng")
    bad = fr.load(tmp_path / "bad.frk")
    assert not equal(ref["model"], bad["model"])


@pytest.mark.slow
def test_tfmd_dl_with_a_random_after_batch_transform(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "tfmd")
    res, _ = crash_and_rerun(tmp_path, "tfmd", "0,1,5")
    assert_same_result(ref, res)


@pytest.mark.parametrize("die", ["0,0,0", "0,1,0"])
def test_a_hidden_state_carried_across_epochs_is_restored_at_an_epoch_boundary(tmp_root, tmp_path, die):
    """The book's LMModel3 without `reset` and without ModelResetter: its `h` goes on from one epoch into the
    next (through validation). Saved at an epoch's end and resumed at the next one's start: that epoch starts
    from the hidden state the uninterrupted run had there."""
    ref = workload_reference(tmp_root, "book-rnn3", "--no-resetter")
    res, log = crash_and_rerun(tmp_path, "book-rnn3", die, "--no-resetter", "--die-event", "after_epoch")
    assert "resuming" in log
    assert_same_result(ref, res)
