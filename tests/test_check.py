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
