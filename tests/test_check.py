"""`fastai-resume check`: a user's own training script, run uninterrupted, killed and resumed, compared
batch by batch; it passes a clean multi-stage script and names a planted divergence."""

import os
import subprocess
import sys

import pytest
from procs import ENV, HERE

from fastai_resume.check import check

WORKLOADS = os.path.join(HERE, "workloads.py")


def test_check_passes_a_clean_multi_stage_script_and_kills_it_in_a_late_stage(tmp_path):
    r = check(
        WORKLOADS,
        ["digits", "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), "--recipe", "stages"],
        batches=5,
        cwd=tmp_path,
    )
    assert r.ok, r.message
    assert r.kill_at[0] == 2 and r.kill_at[1] == 1 and "match the uninterrupted run" in r.message
    assert not list((tmp_path / "models").glob("fastai_resume_check*"))


def test_check_passes_a_script_that_saves_loads_validates_and_runs_lr_find_between_its_stages(tmp_path):
    "The fastai book's pattern (save('1epoch'), load('1epoch'), then the next stage) among others: exact."
    args = ["block", "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), "--recipe", "five"]
    r = check(WORKLOADS, args, batches=4, cwd=tmp_path, kill_at=(3, 0, 2))
    assert r.ok, r.message


def test_check_names_a_between_stage_load_that_goes_another_way_in_the_rerun(tmp_path):
    """A script whose between-stage load depends on what its folder holds loads another file once the
    folder has more in it: the check names that load, not the RNG or data it changes afterwards."""
    args = ["block", "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), "--recipe", "five", "--branch-on-files"]
    r = check(WORKLOADS, args, batches=4, cwd=tmp_path, kill_at=(3, 0, 2))
    assert not r.ok and r.message.startswith("between stages (after stage 1): load of stage1.pth differs"), r.message


BOOK = ["lm-text", "--recipe", "book", "--between", "save-load"]  # the fastai book's chapter 10 (workloads.book)


def test_check_passes_the_books_script_resumed_with_and_without_the_earlier_stages_end_states(tmp_path):
    """Killed in its second stage, the book's script (save('1epoch'), load('1epoch') between the stages) is
    resumed twice: with stage 0's end state (AutoCheckpoint's way) and without it (no resumable save in
    stage 0, `learn.load` at the top), where the replayed load puts 1epoch.pth's weights in the learner
    before the resumed fit: both exact."""
    args = [*BOOK, "--path", str(tmp_path), "--out", str(tmp_path / "o.frk")]
    r = check(WORKLOADS, args, batches=4, cwd=tmp_path)
    assert r.ok and r.kill_at[0] == 1 and r.message.endswith("also with no resumable save in the stages before it")
    assert not list((tmp_path / "models").glob("fastai_resume_check*"))


def test_check_names_the_between_stage_load_a_resumed_stage_trains_on_from(tmp_path):
    """Issue 39's defect planted (`workloads.keep_loaded_weights`: the resumed fit keeps what a
    between-stage load left in the learner unless a skipped stage's end state was restored): the check
    reports the difference and names the load, not the loss or model it changes afterwards. (Run against
    the package before the fix, unplanted, it reports the same; before this check, OK.)"""
    args = [*BOOK, "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), "--keep-loaded-weights"]
    r = check(WORKLOADS, args, batches=4, cwd=tmp_path)
    assert not r.ok and r.message.startswith("between stages (after stage 0): load of 1epoch.pth"), r.message
    assert "did not start from the checkpoint's model" in r.message, r.message


def test_check_finds_a_planted_divergence_and_names_it(tmp_path):
    r = check(
        WORKLOADS,
        ["digits", "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), "--plant"],
        batches=5,
        cwd=tmp_path,
    )
    assert not r.ok and "first difference at stage 0, fit 0, epoch 1, batch 2: data" in r.message, r.message


@pytest.mark.slow
def test_the_check_command_exits_1_on_a_difference_and_0_when_exact(tmp_path):
    base = [
        sys.executable,
        "-m",
        "fastai_resume",
        "check",
        "--batches",
        "4",
        WORKLOADS,
        "digits",
        "--path",
        str(tmp_path),
        "--out",
        str(tmp_path / "o.frk"),
    ]
    env = dict(ENV, PYTHONPATH=os.path.dirname(HERE))
    ok = subprocess.run(base, capture_output=True, text=True, env=env, cwd=tmp_path)
    bad = subprocess.run(base + ["--plant"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("OK   exact"), ok.stdout + ok.stderr
    assert bad.returncode == 1 and bad.stdout.startswith("DIFF first difference"), bad.stdout + bad.stderr


@pytest.mark.parametrize("first", ["fastai_resume", "fastai.learner"])
def test_a_process_the_check_runs_has_its_hooks_whichever_it_imports_first(first):
    "The runtime never imports `check`: the package imports it where the check runs a script, as fastai's Learner arrives."
    other = "fastai.learner" if first == "fastai_resume" else "fastai_resume"
    code = (
        f"import {first}, {other}\n"
        "from fastai_resume import script\n"
        "print(len(script.FIT_HOOKS), len(script.BETWEEN_HOOKS), len(script.STAGE_BEGIN_HOOKS), "
        "'fastai_resume.check' in __import__('sys').modules)"
    )
    env = dict(ENV, PYTHONPATH=os.path.dirname(HERE))
    for mode, want in (("record", "1 1 1 True"), ("", "0 0 0 False")):
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**env, "FASTAI_RESUME_CHECK": mode}
        )
        assert p.returncode == 0 and p.stdout.split("\n")[-2] == want, (mode, p.stdout[-1000:], p.stderr[-2000:])
