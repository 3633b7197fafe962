"""The data a fine-tuner streams (tests/streams.py): a Hugging Face `datasets` stream as users build it,
killed by SIGKILL mid-epoch and run again in a new process (with `learn.load` at the top, or with
`AutoCheckpoint`), ends bitwise equal to the run that never stopped: model, optimizer, Recorder, and the
data of every batch the rerun trains; or the rerun is refused before it trains a batch."""

import functools
import os
import signal
import subprocess
import sys

import pytest
from procs import ENV, FORKS, HERE, equal, shared_run

import fastai_resume as fr
from fastai_resume.check import check

SCRIPT = os.path.join(HERE, "streams.py")


def run_stream(pipeline, path, out, *args, expect=0):
    "tests/streams.py in a new process; `expect`: its exit status (-9: killed by SIGKILL)."
    cmd = [sys.executable, SCRIPT, pipeline, "--path", str(path), "--out", str(out), *args]
    p = FORKS.run(cmd, env=ENV, timeout=900)
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


@functools.cache
def stream_reference(tmp_root, pipeline, *args):
    "The uninterrupted run, shared by the tests of one session."
    name = "st-" + pipeline + "_".join(a.strip("-") for a in args)
    return shared_run(tmp_root, name, lambda d: run_stream(pipeline, d, os.path.join(d, "out.frk"), *args))[0]


def crash_and_rerun(tmp_path, pipeline, die, *args, way="load", expect=0, every="4"):
    "Killed after `die` (epoch,k), then the same script again: its result and what it printed."
    save = ("--auto", every) if way == "auto" else ()
    rerun = ("--auto", every) if way == "auto" else ("--load", "crash")
    run_stream(pipeline, tmp_path, tmp_path / "dead.frk", "--die", die, *save, *args, expect=-signal.SIGKILL)
    log = run_stream(pipeline, tmp_path, tmp_path / "out.frk", *rerun, *args, expect=expect)
    return (fr.load(tmp_path / "out.frk") if expect == 0 else None), log


def assert_same(ref, res):
    "Every batch the rerun trained is the uninterrupted run's, and so is everything at the end."
    assert res["crcs"], "the rerun trained nothing"
    wrong = [k for k, v in res["crcs"].items() if ref["crcs"].get(k) != v]
    assert not wrong, f"the rerun trained other data than the uninterrupted run at (epoch, iter) {wrong[:5]}"
    for key in ("model", "opt", "losses", "lrs", "values"):
        assert equal(ref[key], res[key]), f"{key} differs from the uninterrupted run"


CASES = [
    ("plain", ()),  # a loaded state that sticks to later epochs (fails before the fix)
    ("map-filter", ()),
    ("shuffle", ("--set-epoch",)),  # the shuffle buffer the state leaves out (fails before the fix)
    ("interleave", ()),
    ("custom", ()),
]


@pytest.mark.parametrize("way", ["load", "auto"])
@pytest.mark.parametrize("pipeline,args", CASES, ids=[c[0] for c in CASES])
def test_a_datasets_stream_resumes_exactly(tmp_root, tmp_path, pipeline, args, way):
    ref = stream_reference(tmp_root, pipeline, *args)
    res, log = crash_and_rerun(tmp_path, pipeline, "1,7", *args, way=way)
    assert "resuming" in log and "iteration " in log
    assert_same(ref, res)


@pytest.mark.parametrize("pipeline", ["plain", "shuffle"])
def test_a_stream_resumed_at_an_epoch_boundary_starts_its_next_epoch_where_the_uninterrupted_run_did(
    tmp_root, tmp_path, pipeline
):
    "AutoCheckpoint's epoch-end save (no save by iterations): a stream's end-of-pass state is no position."
    ref = stream_reference(tmp_root, pipeline)
    res, log = crash_and_rerun(tmp_path, pipeline, "1,3", way="auto", every="1000")
    assert "at epoch 1, iteration 0/" in log
    assert_same(ref, res)


@pytest.mark.parametrize("way", ["load", "auto"])
@pytest.mark.parametrize("pipeline", ["plain", "shuffle"])
def test_a_stream_read_by_worker_processes_resumes_exactly(tmp_root, tmp_path, pipeline, way):
    """The state lives in the workers: the main process's copy never moves (fails before the fix). A random
    item transform in the workers: a replayed batch j is seeded as batch j (the replay reads from batch 0)."""
    ref = stream_reference(tmp_root, pipeline, "--workers", "2", "--noise")
    res, log = crash_and_rerun(tmp_path, pipeline, "0,9", "--workers", "2", "--noise", way=way)
    assert "replay" in log
    assert_same(ref, res)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_torchdata_stateful_dataloader_in_fastai_resumes_exactly(tmp_root, tmp_path, workers):
    ref = stream_reference(tmp_root, "stateful", "--workers", workers)
    res, _ = crash_and_rerun(tmp_path, "stateful", "1,5", "--workers", workers)
    assert_same(ref, res)


def test_a_users_stream_with_state_read_by_workers_is_refused_before_training(tmp_path):
    _, log = crash_and_rerun(tmp_path, "custom", "0,9", "--workers", "2", expect=1)
    assert "worker processes" in log and "StatefulDataLoader" in log and "fast_forward=True" in log


# ---- several ranks: a stream split with `split_dataset_by_node`, under torchrun and `distrib_ctx` -----------


def torchrun_stream(pipeline, path, out, *args, ok=True):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = launch + [SCRIPT, pipeline, "--ranks", "--path", str(path), "--out", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    if ok:
        assert p.returncode == 0, p.stdout + p.stderr[-5000:]
    return p


@functools.cache
def ranks_reference(tmp_root, pipeline, *args):
    make = lambda d: torchrun_stream(pipeline, d, os.path.join(d, "out.frk"), *args)  # noqa: E731
    return shared_run(tmp_root, f"st-ranks-{pipeline}" + "_".join(args), make, ("out.frk", "out.frk.rank1"))


@pytest.mark.slow
@pytest.mark.parametrize("way", ["load", "auto"])
@pytest.mark.parametrize("pipeline,args", [("plain", ()), ("shuffle", ("--set-epoch",))], ids=["plain", "shuffle"])
def test_a_stream_split_over_two_ranks_trains_and_resumes_exactly_on_every_rank(
    tmp_root, tmp_path, pipeline, args, way
):
    "fastai's DistributedDL broadcast a stream's list of Nones (a TypeError): each rank now reads its own split."
    ref = ranks_reference(tmp_root, pipeline, *args)
    assert ref[0]["crcs"]["0,0"] != ref[1]["crcs"]["0,0"]  # each rank its own split of the stream
    save = ("--auto", "4") if way == "auto" else ()
    p = torchrun_stream(pipeline, tmp_path, tmp_path / "dead.frk", "--die", "1,6", *save, *args, ok=False)
    assert p.returncode != 0 and "SIGKILL" in p.stdout + p.stderr  # both ranks died hard after the save
    rerun = ("--auto", "4") if way == "auto" else ("--load", "crash")
    p = torchrun_stream(pipeline, tmp_path, tmp_path / "out.frk", *rerun, *args)
    assert p.stdout.count("fastai_resume: resuming") == 2
    for r, out in enumerate(("out.frk", "out.frk.rank1")):
        res = fr.load(tmp_path / out)
        try:
            assert_same(ref[r], res)
        except AssertionError as e:
            raise AssertionError(f"rank {r}: {e}") from None


# ---- beyond the libraries: the data log ----------------------------------------------------------------


@pytest.mark.parametrize("way", ["load", "auto"])
def test_a_stream_whose_loaded_state_does_not_reproduce_is_refused_before_training_a_batch(tmp_path, way):
    "The killed run logged each batch it trained after its save; the rerun's first batch differs: refused."
    later = ("--die-later", "3") if way == "load" else ()  # (AutoCheckpoint saved at 4: 3 batches before)
    _, log = crash_and_rerun(tmp_path, "off-by-one", "1,7", *later, way=way, expect=1)
    assert "StreamDiverged" in log and "is not the batch that run trained there" in log and "OffByOne" in log
    assert "batch 4 of epoch 1" in log if way == "auto" else "batch 7 of epoch 1" in log
    assert not (tmp_path / "out.frk").exists()


def test_the_data_log_is_beside_its_checkpoint_and_goes_with_it(tmp_path):
    "AutoCheckpoint(keep=2): the newest checkpoint's log holds the batches trained after it; a removed one's is gone."
    run_stream("plain", tmp_path, tmp_path / "dead.frk", "--die", "1,7", "--auto", "4", expect=-signal.SIGKILL)
    names = sorted(p.name for p in (tmp_path / "models").rglob("*") if p.is_file())
    # (a save whose thread had not put it in place when the process was killed: whole under its temporary name,
    # put in place by the next start, its log beside it)
    pending = [n[1:].split(".tmp.")[0] for n in names if fr.stored.is_temp(n)]
    frks = sorted([n for n in names if n.endswith(".frk")] + pending)
    logs = [n for n in names if ".datalog" in n]
    assert frks and set(logs) <= {f + ".datalog" for f in frks}, names  # none left of a removed checkpoint
    assert frks[-1] + ".datalog" in logs, names
    newest = (tmp_path / "models").rglob(frks[-1] + ".datalog")
    lines = next(newest).read_text().split("\n")
    assert [ln.split()[:2] for ln in lines if ln] == [["1", "4"], ["1", "5"], ["1", "6"]]


# ---- `fastai-resume check` names the cause ------------------------------------------------------------------


@pytest.mark.parametrize(
    "pipeline,args,cause",
    [
        (
            "sticky",
            (),
            "a loaded state that sticks: the resumed epoch was right, but a later epoch of the stream (Sticky)",
        ),
        ("custom", ("--workers", "2"), "its position lives in the 2 worker processes that read it"),
    ],
    ids=["sticky", "workers"],
)
def test_check_names_a_streams_cause(tmp_path, pipeline, args, cause):
    "A user's stream whose state sticks, or one read by workers (refused at once, saying why): the check says which."
    r = check(
        SCRIPT, [pipeline, "--path", str(tmp_path), "--out", str(tmp_path / "o.frk"), *args], batches=6, cwd=tmp_path
    )
    assert not r.ok and cause in r.message, r.message


@pytest.mark.parametrize("way", ["load", "auto"])
@pytest.mark.parametrize(
    "pipeline,args",
    [("plain", ()), ("plain", ("--workers", "2")), ("shuffle", ())],
    ids=["plain", "workers", "shuffle"],
)
def test_a_stream_killed_in_a_second_stage_resumes_exactly(tmp_root, tmp_path, pipeline, args, way):
    "The first stage passed: its end state must not leave the stream where that stage ended (sticky)."
    ref = stream_reference(tmp_root, pipeline, "--stages", *args)
    res, log = crash_and_rerun(tmp_path, pipeline, "1,7", "--stages", *args, way=way)
    assert "resuming" in log
    assert_same(ref, res)


@pytest.mark.parametrize(
    "pipeline,args",
    [("plain", ()), ("shuffle", ()), ("plain", ("--workers", "2"))],
    ids=["plain", "shuffle", "workers"],
)
def test_a_stream_saved_as_its_epoch_ended_resumes_its_next_epochs_exactly(tmp_root, tmp_path, pipeline, args):
    """Saved after the epoch's last batch (position (e, n_iter)), killed in the validation after it: the
    `datasets` stream's end-of-pass state is not loaded (it would stick), and no epoch is replayed."""
    ref = stream_reference(tmp_root, pipeline, *args)
    res, log = crash_and_rerun(tmp_path, pipeline, "0,20", "--die-in-valid", *args)
    assert "at epoch 0, iteration 20/20" in log
    assert_same(ref, res)


def test_a_logged_batch_the_rerun_does_not_draw_is_a_divergence(tmp_path):
    "A user's stream whose state ends the epoch early: the batches the saving run trained there were not drawn."
    _, log = crash_and_rerun(tmp_path, "early-end", "1,7", "--die-later", "3", expect=1)
    assert "StreamDiverged" in log and "or was not drawn" in log and "batch 8 of epoch 1" in log
