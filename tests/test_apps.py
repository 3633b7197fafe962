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


def run_app(app, folder, out, *args, expect=0):
    p = FORKS.run([sys.executable, os.path.join(HERE, "apps.py"), app, "--out", str(out), *args], ENV, 900, cwd=folder)
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


def test_text_negative_control_a_resume_without_its_rng_state_differs(tmp_root, tmp_path):
    ref, _ = app_reference(tmp_root, "text")
    res, log = crash_and_rerun(tmp_path, "text", TEXT_KILLS["clas-1"], "manual", "--break-rng")
    assert "resuming" in log
    assert not equal(ref["clas"]["model"], res["clas"]["model"])


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
