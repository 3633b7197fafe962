"""fastai's applications as their docs and the book build them (tests/apps.py: the text application's
ULMFiT recipe with both of its learners, vision_learner, unet_learner, tabular_learner, collab_learner),
killed by SIGKILL mid-stage and run again unchanged, from a fresh folder with fastai's default relative
paths: the rerun ends bitwise equal to a run that never checkpointed (every learner's model, optimizer
and Recorder, every value the script prints, every file it writes), resumed by hand (`learn.load` at
the top) and by AutoCheckpoint; with a negative control."""

import os
import signal
import sys

import pytest
from procs import ENV, FORKS, equal, shared_run

import fastai_resume as fr

HERE = os.path.dirname(os.path.abspath(__file__))


def run_app(app, folder, out, *args, expect=0, env=None):
    cmd = [sys.executable, os.path.join(HERE, "apps.py"), app, "--out", str(out), *args]
    p = FORKS.run(cmd, dict(ENV, **(env or {})), 900, cwd=folder)
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def values(log):
    return [line for line in log.splitlines() if line.startswith("VALUES")]


def app_reference(tmp_root, app):
    "The script run once without any checkpointing, shared by the tests of a session."

    def make(d):
        log = run_app(app, d, os.path.join(d, "out.frk"), "--resume", "none")
        with open(os.path.join(d, "values.txt"), "w") as f:
            f.write("\n".join(values(log)))

    (ref,) = shared_run(tmp_root, f"app-{app}", make)
    with open(os.path.join(tmp_root, f"app-{app}", "values.txt")) as f:
        return ref, f.read().splitlines()


def crash_and_rerun(tmp_path, app, die, resume, *extra):
    run_app(app, tmp_path, tmp_path / "dead.frk", "--die", die, "--resume", resume, expect=-signal.SIGKILL)
    log = run_app(app, tmp_path, tmp_path / "out.frk", "--resume", resume, *extra)
    return fr.load(tmp_path / "out.frk"), log


def assert_same(ref, res, learners):
    for name in learners:
        for key in ("model", "opt", "losses", "lrs", "values"):
            assert equal(ref[name][key], res[name][key]), f"{name}: {key} differs from the uninterrupted run"
    assert ref["files"] == res["files"], "the files the script wrote differ from the uninterrupted run's"


# stages of the text script: 0-1 the language model (fit_one_cycle; unfreeze, fit_one_cycle),
# 2-4 the classifier (fit_one_cycle; freeze_to(-2), fit_one_cycle; unfreeze, fit_one_cycle(2))
TEXT_KILLS = {"lm-0": "0,0,7", "lm-1": "1,1,4", "clas-0": "2,0,6", "clas-1": "3,0,3", "clas-2": "4,1,5"}
FAST = {("lm-1", "manual"), ("clas-1", "auto")}  # `make quick` runs these two; the others are marked slow


@pytest.mark.parametrize(
    "where, resume",
    [
        pytest.param(w, r, marks=() if (w, r) in FAST else pytest.mark.slow)
        for w in TEXT_KILLS
        for r in ("manual", "auto")
    ],
)
def test_text_application_recipe_killed_in_any_stage_of_either_learner_is_exact(tmp_root, tmp_path, where, resume):
    ref, ref_values = app_reference(tmp_root, "text")
    res, log = crash_and_rerun(tmp_path, "text", TEXT_KILLS[where], resume)
    assert "resuming" in log
    assert values(log) == ref_values
    assert_same(ref, res, ("lm", "clas"))
    assert set(ref["files"]) >= {"models/1epoch.pth", "models/finetuned.pth"}


def test_the_text_recipes_gradual_unfreezing_checkpoints_hold_what_trains_and_the_frozen_rest_by_fingerprint(
    tmp_root, tmp_path
):
    """freeze_to(-2) of the classifier (stage 3): the encoder's frozen layers are referenced, not written;
    killed there and rerun, exact (the kill and rerun of the test above, with what the checkpoint held)."""
    ref, ref_values = app_reference(tmp_root, "text")
    run_app("text", tmp_path, tmp_path / "dead.frk", "--die", TEXT_KILLS["clas-1"], expect=-signal.SIGKILL)
    tree = fr.info(tmp_path / "models" / "clas-crash.frk")["tree"]
    assert tree["frozen"] and all(k.startswith("0.module.") for k in tree["frozen"])  # the encoder's frozen part
    assert any(k.startswith("1.") for k in tree["model"])  # the head trains
    log = run_app("text", tmp_path, tmp_path / "out.frk")
    assert values(log) == ref_values
    assert_same(ref, fr.load(tmp_path / "out.frk"), ("lm", "clas"))


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["manual", "auto"])
def test_vision_fine_tune_killed_in_its_frozen_epoch_is_exact_and_its_checkpoint_references_the_body(
    tmp_root, tmp_path, resume
):
    """fine_tune's first fit trains the head and the frozen body's BatchNorm layers (train_bn): the
    checkpoint holds those (and every running statistic), references the body's convolutions."""
    ref, ref_values = app_reference(tmp_root, "vision")
    run_app("vision", tmp_path, tmp_path / "dead.frk", "--die", "0,0,4", "--resume", resume, expect=-signal.SIGKILL)
    ckpts = sorted((tmp_path / "models").glob("*.frk"))
    tree = fr.info(ckpts[-1])["tree"]
    assert tree["train"]["position"]["fit_index"] == 0  # killed in the frozen epoch
    assert any(k.endswith("conv1.weight") for k in tree["frozen"]) and not any("bn" in k for k in tree["frozen"])
    assert any(k.endswith("bn1.weight") for k in tree["model"]) and any(
        k.endswith("running_var") for k in tree["model"]
    )
    log = run_app("vision", tmp_path, tmp_path / "out.frk", "--resume", resume)
    assert "resuming" in log and values(log) == ref_values
    assert_same(ref, fr.load(tmp_path / "out.frk"), ("model",))


def test_text_negative_control_a_resume_without_its_rng_state_differs(tmp_root, tmp_path):
    ref, _ = app_reference(tmp_root, "text")
    res, log = crash_and_rerun(tmp_path, "text", TEXT_KILLS["lm-1"], "manual", "--break-rng")
    assert "resuming" in log
    assert not equal(ref["lm"]["model"], res["lm"]["model"])


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["manual", "auto"])
@pytest.mark.parametrize(
    "app, die", [("vision", "0,1,4"), ("unet", "0,0,5"), ("tabular", "0,1,5"), ("collab", "0,2,7")]
)
def test_each_application_recipe_killed_mid_stage_is_exact(tmp_root, tmp_path, app, die, resume):
    ref, ref_values = app_reference(tmp_root, app)
    res, log = crash_and_rerun(tmp_path, app, die, resume)
    assert "resuming" in log
    assert values(log) == ref_values
    assert_same(ref, res, ("model",))
