"""A training script is more than one fit: the ULMFiT-style recipe of tests/workloads.py (lr_find,
fit_one_cycle, freeze_to(-2), fit_one_cycle, unfreeze, fit_one_cycle, with a CSVLogger), killed by
SIGKILL in each stage and run again unchanged, ends bitwise equal to the uninterrupted run, history
file included; a changed script is refused with what differs."""

import pytest
from procs import assert_same_result, crash_and_rerun, run_workload, workload_reference

import fastai_resume as fr

STAGES = ("--recipe", "stages")


@pytest.mark.parametrize("die", ["0,1,3", "1,0,10", "2,1,4"], ids=["stage-0", "stage-1", "stage-2"])
def test_killed_in_any_stage_the_rerun_skips_finished_stages_and_is_exact(tmp_root, tmp_path, die):
    ref = workload_reference(tmp_root, "digits", *STAGES)
    res, log = crash_and_rerun(tmp_path, "digits", die, *STAGES)
    stage = int(die[0])
    for s in range(stage):
        assert f"skipping stage {s} (fit_one_cycle)" in log
    assert f"skipping stage {stage}" not in log
    assert_same_result(ref, res)


@pytest.mark.slow
def test_language_model_stages_with_autocheckpoint(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "lm", *STAGES, "--auto", "4")
    res, log = crash_and_rerun(tmp_path, "lm", "2,0,6", *STAGES, "--auto", "4", rerun=())
    assert "AutoCheckpoint: found" in log and "skipping stage 1 (fit_one_cycle)" in log
    assert_same_result(ref, res)


@pytest.mark.slow
def test_csv_logger_append_mode_holds_each_row_once(tmp_root, tmp_path):
    ref = workload_reference(tmp_root, "digits", *STAGES, "--csv-append")
    res, _ = crash_and_rerun(tmp_path, "digits", "2,1,4", *STAGES, "--csv-append")
    assert ref["csv"].count("epoch,") == 4  # one header per stage, and one from lr_find's fit
    assert_same_result(ref, res)


def test_a_changed_script_is_refused_with_the_difference(tmp_path):
    _, log = crash_and_rerun(
        tmp_path, "digits", "1,0,10", *STAGES, rerun=("--load", "crash", "--lr", "0.005"), expect=1
    )
    assert "stage 0 of this script differs" in log and "lr_max 0.01 -> 0.005" in log and "resume=False" in log


def test_a_frozen_stage_after_an_unfrozen_one_resumes_exactly_after_the_rerun_skipped_it(tmp_path):
    """fastai's optimizer steps every parameter that has a gradient, a frozen one with a zero gradient
    too (its Adam moments and weight decay go on). After an unfrozen stage the frozen body has zero
    gradients; a rerun that skips that stage has none unless the checkpoint says which existed.
    (In one process: a new Learner is a new script, with a new model that has no gradients.)"""
    from fastai.callback.core import Callback, CancelFitException
    from fastai.torch_core import params
    from procs import equal
    from trainer import build, result

    def learner():
        learn = build(tmp_path, noise=False)
        learn.splitter = lambda m: [params(m[0]), params(m[3])]  # the body and the head
        return learn

    class SaveAndStop(Callback):
        order = 100

        def after_batch(self):
            if self.training and self.epoch == 1 and self.iter == 7:
                self.learn.save("ck", with_iter=True)
                raise CancelFitException()

    def script(learn, cbs=()):
        with learn.no_bar(), learn.no_logging():
            learn.unfreeze()
            learn.fit_one_cycle(1, 1e-2)
            learn.freeze()
            learn.fit_one_cycle(2, 1e-2, cbs=list(cbs))
        return learn

    want = result(script(learner()))
    script(learner(), [SaveAndStop()])
    rerun = learner()
    rerun.load("ck")
    got = result(script(rerun))
    for key in ("model", "opt", "losses", "lrs"):
        assert equal(want[key], got[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.slow
def test_a_new_autocheckpoint_given_to_each_fit_call_is_one_run_uninterrupted_and_killed(tmp_root, tmp_path):
    """`fit_one_cycle(..., cbs=[AutoCheckpoint(...)])` in every stage: each instance is the same run
    (its files, its attempt, one autoresume per process). Uninterrupted, the script runs through (the
    second instance once autoresumed from the first one's end-of-fit file and refused the stage);
    killed in its last stage and run again unchanged, it ends bitwise equal."""
    args = (*STAGES, "--auto-per-fit", "4")
    ref = workload_reference(tmp_root, "digits", *args)
    res, log = crash_and_rerun(tmp_path, "digits", "2,0,6", *args, rerun=())
    assert log.count("AutoCheckpoint: found") == 1 and "skipping stage 1 (fit_one_cycle)" in log
    assert_same_result(ref, res)


FIVE = ("--recipe", "five")
FIVE_KILLS = {"stage-0": "0,0,10", "stage-1": "1,1,5", "stage-2": "2,0,8", "stage-3": "3,0,12", "stage-4": "4,0,6"}
FIVE_WAYS = {"load": ("--save-every", "4"), "auto": ("--auto", "4")}
FIVE_FAST = {("stage-2", "load"), ("stage-4", "auto")}  # `make quick` runs these; the others are marked slow


@pytest.mark.parametrize(
    "where, how",
    [pytest.param(w, h, marks=() if (w, h) in FIVE_FAST else pytest.mark.slow) for w in FIVE_KILLS for h in FIVE_WAYS],
)
def test_a_five_stage_script_killed_in_any_stage_is_the_uninterrupted_run_at_every_line(tmp_root, tmp_path, where, how):
    """Between its stages the script prints the Recorder's last row and validate(), saves a model under
    a name and loads it back, runs lr_find and fits with its suggestion, exports (tests/workloads.py
    `five_stages`). Killed in any stage and run again unchanged (with `learn.load('crash')` at the top,
    or AutoCheckpoint), every printed value, every file and the final state are the uninterrupted run's,
    and no file the uninterrupted run wrote is written again with other bytes."""
    args = (*FIVE, *FIVE_WAYS[how])
    ref = workload_reference(tmp_root, "block", *args)
    rerun = ("--load", "crash") if how == "load" else ()
    killed = {}

    def snapshot_files():
        models = tmp_path / "models"
        for p in models.iterdir():
            if p.suffix in (".pth", ".pkl"):
                killed[p.name] = p.read_bytes()

    run_workload("block", tmp_path, tmp_path / "dead.frk", "--die", FIVE_KILLS[where], *args, expect=-9)
    snapshot_files()
    log = run_workload("block", tmp_path, tmp_path / "out.frk", *args, *rerun)
    res = fr.load(tmp_path / "out.frk")
    stage = int(FIVE_KILLS[where][0])
    assert log.count("restored as it ended") == stage and "cancelled" not in log
    assert res["printed"] == ref["printed"]
    assert_same_result(ref, res, ("model", "opt", "losses", "lrs", "values", "rng", "csv", "files"))
    for name, data in killed.items():  # what the killed run wrote is what the rerun leaves there
        assert (tmp_path / "models" / name).read_bytes() == data, name


def test_activation_stats_read_after_each_stage_are_the_uninterrupted_runs(tmp_root, tmp_path):
    """fastai's `ActivationStats` (the book's chapter 13: every batch's mean, std and histogram of each
    layer's activations, plotted after a fit) keeps them in the callback, not in the Recorder. The five
    stages with `ActivationStats(with_hist=True, every=2)`, killed in stage 2 and run again with
    AutoCheckpoint: what the script reads after the two skipped stages (restored as they ended) and after
    the resumed one (half of its batches recorded before the kill) is the uninterrupted run's."""
    args = (*FIVE, "--auto", "4", "--act-stats")
    ref = workload_reference(tmp_root, "block", *args)
    run_workload("block", tmp_path, tmp_path / "dead.frk", "--die", "2,0,8", *args, expect=-9)
    log = run_workload("block", tmp_path, tmp_path / "out.frk", *args)
    res = fr.load(tmp_path / "out.frk")
    assert log.count("restored as it ended") == 2
    assert [p for p in ref["printed"] if p.startswith("acts-")] == [
        p for p in res["printed"] if p.startswith("acts-")
    ] and len([p for p in ref["printed"] if p.startswith("acts-")]) == 5
    assert res["printed"] == ref["printed"]
    assert_same_result(ref, res, ("model", "opt", "losses", "lrs", "values", "rng", "csv", "files"))


def test_a_rerun_that_cannot_have_a_stages_end_state_refuses_before_it_writes(tmp_path):
    """Killed in stage 2 of a script whose only resumable save is the one at the kill (no checkpoint in the
    stages before it, so their end states were never kept), rerun with `learn.load('crash')` at the top,
    after `models/stage0.pth` was lost: the learner after the skipped stage 0 is not the uninterrupted
    run's. The rerun says so when it skips the stage, gives the Recorder's numbers and validate() of the
    uninterrupted run from the checkpoint's log, and refuses `learn.save('stage0')`: nothing is written
    from a state that is not the uninterrupted run's."""

    run_workload("block", tmp_path, tmp_path / "dead.frk", "--die", "2,0,8", *FIVE, expect=-9)
    (tmp_path / "models" / "stage0.pth").unlink()
    log = run_workload("block", tmp_path, tmp_path / "out.frk", *FIVE, "--load", "crash", expect=1)
    assert "not stage 0's end: no resumable checkpoint was saved in that stage" in log
    assert "VALUES stage-0" in log and "VALUES valid-0" in log
    assert "ReplayError" in log and "learn.save('stage0')" in log and "nothing was written" in log
    assert not (tmp_path / "models" / "stage0.pth").exists()


def test_a_rerun_from_a_checkpoint_at_a_stages_very_end_continues_the_next_stage_exactly(tmp_root, tmp_path):
    """AutoCheckpoint's last checkpoint of a stage is at its very end (every epoch done). When it is the
    newest (the next stage's were lost, or a remote mirror lags), the rerun resumes the stage at its end,
    with the loaders, RNG and schedule the stage ended with, and the next stage trains as it did."""
    args = (*STAGES, "--auto", "4")
    ref = workload_reference(tmp_root, "digits", *args)
    run_workload("digits", tmp_path, tmp_path / "dead.frk", "--die", "2,0,6", *args, expect=-9)
    for p in (tmp_path / "models").glob("auto-*-s002-*"):
        p.unlink()
    log = run_workload("digits", tmp_path, tmp_path / "out.frk", *args)
    assert "-s001-f00-e000002-i0000000000.frk" in log and "skipping stage 0" in log
    assert_same_result(ref, fr.load(tmp_path / "out.frk"))
