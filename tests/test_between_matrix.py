"""Whatever a script calls between its stages, and whichever way it resumes, the rerun of the unchanged
script is the uninterrupted run at every line, or it is refused loudly. The cells are generated, not
picked: resume way {AutoCheckpoint, `learn.load('crash')` at the top} x the stage killed {0, 1, 2} x
{the stages before it made resumable saves, or not} x the call the script makes after stages 0 and 1
(`workloads.BETWEEN`: save and load of the same name, load of another name, as `.pth` and as `.frk`,
save_encoder/load_encoder, validate, lr_find, export, get_preds; each after reading `recorder.values`), on the fastai book's chapter-10 script (`workloads.book`: a frozen stage, save('1epoch'),
load('1epoch'), unfreeze, two more stages) with a tiny AWD-LSTM `LMLearner`.

9 calls x (2 ways x 1 for stage 0 + 2 ways x 2 x 2 for stages 1 and 2) = 90 cells, each a killed run and
its rerun (forked, ~1 s each), against 9 uninterrupted runs shared by the session: about 2.5 minutes on
2 cores (`pytest -n 2 tests/test_between_matrix.py`).

Each cell compares the model, the optimizer, the Recorder, the RNGs' next draws, every printed value and
every file the script wrote between its stages (by CRC32C) with the uninterrupted run; a file the killed
run wrote (export's pickle, which is never the same twice) is left as it was, except where the rerun
trains the stages before the killed one again (AutoCheckpoint given only to the killed stage: nothing of
theirs was saved, so they are new lines to the rerun, as they were to the killed run). The one cell kind that
cannot be exact is refused: `get_preds` after stages the rerun skipped without their end states (no
resumable save in them, resumed by `learn.load`): the predictions are not kept, only their digest.
"""

import itertools
import signal

import pytest
from procs import assert_same_result, run_workload, workload_reference
from workloads import BETWEEN

import fastai_resume as fr

BOOK = ("--recipe", "book")
KILLS = {0: "0,0,9", 1: "1,1,5", 2: "2,0,7"}  # (stage, epoch, batches done) in the 29 batches of an epoch


def _args(way: str, stage: int, earlier: bool) -> tuple:
    "The script's options for a resume `way`, with or without resumable saves in the stages before `stage`."
    if way == "auto":
        return ("--auto", "4") if earlier else ("--auto-in", str(stage))
    return ("--save-every", "4") if earlier else ()


def _cells():
    for op, way, stage in itertools.product(BETWEEN, ("auto", "load"), KILLS):
        for earlier in (True, False) if stage else (True,):
            yield pytest.param(op, way, stage, earlier, id=f"{op}-{way}-s{stage}-{'saves' if earlier else 'nosave'}")


def refused(op: str, way: str, stage: int, earlier: bool) -> bool:
    """The rule: refused where the rerun must answer `get_preds` before the stage it resumes without the
    uninterrupted run's state (a skipped stage whose end state was not kept)."""
    return op == "get_preds" and way == "load" and stage > 0 and not earlier


@pytest.mark.parametrize("op, way, stage, earlier", list(_cells()))
def test_a_rerun_is_the_uninterrupted_run_whatever_the_script_calls_between_its_stages(
    tmp_root, tmp_path, op, way, stage, earlier
):
    ref = workload_reference(tmp_root, "lm-text", *BOOK, "--between", op)  # no checkpoint at all
    args = (*BOOK, "--between", op, *_args(way, stage, earlier))
    run_workload("lm-text", tmp_path, tmp_path / "dead.frk", "--die", KILLS[stage], *args, expect=-signal.SIGKILL)
    killed = {p.name: p.read_bytes() for p in tmp_path.glob("*.pkl")}
    rerun = ("--load", "crash") if way == "load" else ()
    if refused(op, way, stage, earlier):
        log = run_workload("lm-text", tmp_path, tmp_path / "out.frk", *args, *rerun, expect=1)
        assert "ReplayError" in log and "learn.get_preds()" in log and "nothing was written" in log, log
        return
    log = run_workload("lm-text", tmp_path, tmp_path / "out.frk", *args, *rerun)
    assert "cancelled" not in log, log
    res = fr.load(tmp_path / "out.frk")
    assert res["printed"] == ref["printed"]
    assert_same_result(ref, res, ("model", "opt", "losses", "lrs", "values", "rng", "files"))
    if way == "auto" and not earlier:
        assert log.count("AutoCheckpoint: found") == 1 and "skipping stage" not in log, log
        return
    for name, data in killed.items():
        assert (tmp_path / name).read_bytes() == data, f"{name} was written again"


def test_negative_control_the_matrix_catches_a_resumed_fit_that_keeps_a_between_stage_loads_weights(tmp_root, tmp_path):
    """The book's cell of the matrix (killed in stage 1, no resumable save in stage 0, `learn.load('crash')`
    at the top) with issue 39's defect planted (`workloads.keep_loaded_weights`): the rerun says nothing,
    and the comparison the matrix makes fails."""
    ref = workload_reference(tmp_root, "lm-text", *BOOK, "--between", "save-load")
    args = (*BOOK, "--between", "save-load", "--keep-loaded-weights")
    run_workload("lm-text", tmp_path, tmp_path / "dead.frk", "--die", KILLS[1], *args, expect=-signal.SIGKILL)
    log = run_workload("lm-text", tmp_path, tmp_path / "out.frk", *args, "--load", "crash")
    res = fr.load(tmp_path / "out.frk")
    assert "cancelled" not in log and "Error" not in log
    with pytest.raises(AssertionError, match="model differs"):
        assert_same_result(ref, res, ("model", "opt", "losses", "lrs", "values", "rng", "files"))
