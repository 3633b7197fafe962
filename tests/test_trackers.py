"""Experiment trackers continue the same run after a resume: a run that checkpoints at iteration K,
goes on training, dies by SIGKILL and is restarted in a new process logs, as TensorBoard and W&B
(offline) read their files, the steps and values the uninterrupted run logged.

This file is also the training script the tests run as real processes:
`python tests/test_trackers.py --path DIR --tracker tensorboard|wandb [--save-at E,K --die-at E,K] [--resume NAME]`.
"""

import argparse
import glob
import os
import shutil
import signal
import struct
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

EPOCHS, N_ITER = 2, 46
SAVE_AT, DIE_AT = (1, 10), (1, 25)  # the crash comes 15 batches after the last checkpoint
WANDB_ID = "frk-tracker-test"  # the run id a preemptible job passes to wandb.init, the same on every restart


# ---- the training script -------------------------------------------------------------------


def train(a):
    import fastai_resume.trackers  # (importing the package patches fastai)

    if a.without_tracker_state:
        fastai_resume.trackers.HANDLERS.clear()
    from fastai.callback.core import Callback
    from trainer import build

    class SaveThenDie(Callback):
        "A checkpoint at one batch, a crash at a later one: the tracker logs steps in between."

        order = 100

        def after_batch(self):
            if not self.training:
                return
            at = (self.epoch, self.iter + 1)
            if at == a.save_at:
                self.learn.save("crash", with_iter=True)
            if at == a.die_at:
                os.kill(os.getpid(), signal.SIGKILL)

    if a.tracker == "tensorboard":
        from fastai.callback.tensorboard import TensorBoardCallback

        cb = TensorBoardCallback(
            trace_model=False, log_preds=False
        )  # log_dir=None: fastai's default, runs/<time>_<host>
    else:
        import fastai.callback.wandb as fastai_wandb
        import wandb
        from fastai.callback.wandb import WandbCallback

        fmt = fastai_wandb._format_config_value

        def tolerant(
            v,
        ):  # fastai 2.8.9-2.8.12 fail on any primitive config value (fastai issue #4173): keep those as they are
            try:
                return fmt(v)
            except TypeError:
                return v

        fastai_wandb._format_config_value = tolerant
        wandb.init(project="frk", id=WANDB_ID, resume="allow", dir=a.path, mode="offline")
        cb = WandbCallback(log_preds=False)
    learn = build(a.path, extra_cbs=[cb])
    fit_cbs = [SaveThenDie()] if a.save_at else []
    if a.resume:
        learn.load(a.resume)
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(EPOCHS, 1e-2, cbs=fit_cbs)
    if a.tracker == "wandb":
        wandb.finish()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--tracker", choices=["tensorboard", "wandb"], required=True)
    ap.add_argument("--save-at", type=lambda s: tuple(map(int, s.split(","))), default=None)
    ap.add_argument("--die-at", type=lambda s: tuple(map(int, s.split(","))), default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument(
        "--without-tracker-state",
        action="store_true",
        help="negative control: resume without fastai_resume.trackers' state capture and restore",
    )
    train(ap.parse_args(argv))


# ---- reading what the trackers wrote -------------------------------------------------------


def run_script(path, tracker, *args, expect_kill=False):
    from procs import FORKS  # not at the top: this file is also the training script, which imports the package itself

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # a run in this process sets some
    env.update(
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        WANDB_CONSOLE="off",
    )
    p = FORKS.run([sys.executable, __file__, "--path", str(path), "--tracker", tracker, *args], env, 600, path)
    assert p.returncode == (-signal.SIGKILL if expect_kill else 0), p.stdout + p.stderr
    return p.stdout


def tensorboard_scalars(log_dir) -> dict:
    "What TensorBoard shows for `log_dir`: {tag: [(step, value)]}, events a restart purged left out."
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path) -> list:
    """The records of a W&B offline run file (`run-ID.wandb`): W&B's LevelDB-style log of protobuf
    `Record`s (7-byte header ':W&B' 0xBEE1 version, then 32 KiB blocks of crc32, length, type chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:6] == b":W&B\xe1\xbe", f"{path} is not a W&B run file"
    pos, block, raws, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 1:
            raws.append(chunk)  # a full record
        elif kind == 2:
            buf = chunk  # first, middle and last pieces of a record across blocks
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            raws.append(buf + chunk)
    recs = []
    for raw in raws:
        r = pb.Record()
        r.ParseFromString(raw)
        recs.append(r)
    return recs


TIMING = {"_runtime", "_timestamp", "train_samples_per_sec"}  # wall-clock values differ between any two runs


def wandb_history(run_dir) -> dict:
    "{step: {key: value}} of every history row an offline W&B run logged (timings left out)."
    import json

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") != "history":
            continue
        row = {
            k: json.loads(i.value_json) for i in r.history.item if (k := i.key or "/".join(i.nested_key)) not in TIMING
        }
        step = row.pop("_step")
        if row:
            out.setdefault(step, {}).update(row)
    return out


def wandb_runs(path) -> list:
    return sorted(glob.glob(os.path.join(path, "wandb", "offline-run-*")))


# ---- the tests -----------------------------------------------------------------------------


def crash_then_resume(path, control, tracker):
    """Train until the crash in `path`, then resume it there and, from a copy of the crashed run's
    files, in `control` without the trackers' state (the negative control)."""
    save, die = (",".join(map(str, SAVE_AT)), ",".join(map(str, DIE_AT)))
    run_script(path, tracker, "--save-at", save, "--die-at", die, expect_kill=True)
    assert (path / "models" / "crash.frk").exists()
    shutil.copytree(path, control, dirs_exist_ok=True)
    run_script(path, tracker, "--resume", "crash")  # right after the killed run: another hash seed
    # TensorBoard's default log dir is named by the second a run starts: a restarted job starts later
    # than its killed run did (here a forked interpreter could start within that second)
    time.sleep(1.0)
    run_script(control, tracker, "--resume", "crash", "--without-tracker-state")


def runs_of(tracker, tmp_path_factory):
    ref, res, control = (tmp_path_factory.mktemp(f"{tracker}_{n}") for n in ("ref", "res", "control"))
    run_script(ref, tracker)
    crash_then_resume(res, control, tracker)
    return ref, res, control


STEP_SAVED = SAVE_AT[0] * N_ITER + SAVE_AT[1]  # Learner.train_iter at the checkpoint
STEP_DIED = DIE_AT[0] * N_ITER + DIE_AT[1]


@pytest.fixture(scope="module")
def tensorboard_runs(tmp_path_factory):
    pytest.importorskip("tensorboard")
    return runs_of("tensorboard", tmp_path_factory)


def tensorboard_view(path) -> dict:
    "The scalars of every log dir under `path/runs`, as one run: {tag: [(step, value)]}."
    got = {}
    for d in sorted(glob.glob(str(path / "runs" / "*"))):
        for tag, pts in tensorboard_scalars(d).items():
            got.setdefault(tag, []).extend(pts)
    return got


@pytest.mark.slow
def test_tensorboard_reference_run_logs_every_step_in_one_dir(tensorboard_runs):
    ref, _, _ = tensorboard_runs
    (log_dir,) = glob.glob(str(ref / "runs" / "*"))
    steps = [s for s, _ in tensorboard_scalars(log_dir)["train_loss"]]
    assert sorted(set(steps)) == list(range(1, EPOCHS * N_ITER + 1))  # (fastai logs validation batches too)


@pytest.mark.slow
def test_tensorboard_resumed_run_continues_in_the_same_log_dir(tensorboard_runs):
    _, res, _ = tensorboard_runs
    dirs = glob.glob(str(res / "runs" / "*"))
    assert len(dirs) == 1, f"the resumed run opened a log dir of its own: {dirs}"
    assert len(glob.glob(os.path.join(dirs[0], "events.out.tfevents.*"))) == 2  # the killed run's, the resumed run's


@pytest.mark.slow
def test_tensorboard_shows_the_uninterrupted_runs_steps_and_values(tensorboard_runs):
    ref, res, _ = tensorboard_runs
    want, got = tensorboard_view(ref), tensorboard_view(res)
    assert sorted(got) == sorted(want) and "valid_loss" in want and "lr_0" in want
    for tag in want:
        assert got[tag] == want[tag], f"{tag}: the resumed run's steps or values differ from the uninterrupted run"


@pytest.mark.slow
def test_tensorboard_negative_control_without_the_state_steps_are_logged_twice(tensorboard_runs):
    ref, _, control = tensorboard_runs
    want, got = tensorboard_view(ref), tensorboard_view(control)
    assert len(glob.glob(str(control / "runs" / "*"))) == 2
    steps = [s for s, _ in got["train_loss"]]
    assert steps != [s for s, _ in want["train_loss"]]
    assert steps.count(STEP_SAVED + 1) == 2  # by the killed run (after its checkpoint), then by the resumed one


def test_tensorboard_events_before_a_checkpoint_are_on_disk_when_it_is_taken(tmp_path):
    "A SIGKILL right after a checkpoint loses no step before it (the writer queues 10 events)."
    pytest.importorskip("tensorboard")
    from fastai.callback.core import Callback, CancelFitException
    from fastai.callback.tensorboard import TensorBoardCallback
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from trainer import build

    from fastai_resume import trackers

    on_disk = []

    class Checkpoint(Callback):
        order = 100

        def after_batch(self):
            if not (self.training and self.iter == 6):
                return
            cb = self.learn.tensor_board
            assert trackers.tensorboard_state(cb) == {"log_dir": str(tmp_path / "tb"), "step": 7}
            (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
            on_disk.extend(
                e.step
                for e in EventFileLoader(path).Load()
                if e.summary.value and e.summary.value[0].tag == "train_loss"
            )
            raise CancelFitException()

    learn = build(
        tmp_path, extra_cbs=[TensorBoardCallback(log_dir=tmp_path / "tb", trace_model=False, log_preds=False)]
    )
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=Checkpoint())
    assert on_disk == [1, 2, 3, 4, 5, 6, 7]


def restore_tensorboard(path, tree, log_dir=None):
    """A fit whose TensorBoardCallback gets `tree` restored where a resumed fit restores it (after
    the callbacks' `before_fit`); returns the callback, its writer still as the restore left it."""
    from fastai.callback.core import Callback, CancelFitException
    from fastai.callback.tensorboard import TensorBoardCallback
    from trainer import build

    from fastai_resume import trackers

    tb = TensorBoardCallback(log_dir=log_dir, trace_model=False, log_preds=False)

    class Restore(Callback):
        order = 200

        def before_fit(self):
            trackers.load_tensorboard(tb, tree)
            raise CancelFitException()

    learn = build(path, extra_cbs=[tb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=Restore())
    return tb


def tensorboard_restarts(log_dir) -> list:
    "The steps at which a writer told TensorBoard to purge what earlier files logged from there on."
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    files = glob.glob(os.path.join(str(log_dir), "events.out.tfevents.*"))
    return [e.step for f in files for e in EventFileLoader(f).Load() if e.session_log.status == SessionLog.START]


def test_tensorboard_keeps_a_log_dir_the_user_named(tmp_path):
    "Only fastai's clock-named default dir is replaced by the checkpoint's; a named one is the user's choice."
    pytest.importorskip("tensorboard")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "events.out.tfevents.1.host").write_bytes(b"")
    tb = restore_tensorboard(tmp_path, {"log_dir": str(tmp_path / "elsewhere"), "step": 40}, str(tmp_path / "mine"))
    assert tb.writer.log_dir == str(tmp_path / "mine")
    assert len(glob.glob(str(tmp_path / "mine" / "events.out.tfevents.*"))) == 2
    assert tensorboard_restarts(tmp_path / "mine") == [41]  # TensorBoard hides what the first file logged from 41 on
    assert os.listdir(tmp_path / "elsewhere") == ["events.out.tfevents.1.host"]


def test_tensorboard_a_log_dir_that_is_gone_is_not_recreated(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)  # fastai's default log dir is runs/<time>_<host> in the working directory
    with pytest.warns(UserWarning, match="holds no events"):
        tb = restore_tensorboard(tmp_path, {"log_dir": str(tmp_path / "gone"), "step": 40})
    assert not (tmp_path / "gone").exists()
    assert os.path.dirname(tb.writer.log_dir) == "runs" and tensorboard_restarts(tb.writer.log_dir) == []


@pytest.mark.parametrize(
    "tree",
    [{"log_dir": 3, "step": 40}, {"log_dir": "runs/x"}, {"log_dir": "runs/x", "step": True}, [1]],
    ids=["log_dir-int", "no-step", "step-bool", "a-list"],
)
def test_tensorboard_state_of_the_wrong_shape_is_a_checkpoint_error(tmp_path, tree):
    pytest.importorskip("tensorboard")
    from fastai_resume import CheckpointError

    with pytest.raises(CheckpointError, match="callback state TensorBoardCallback: .*wrong type"):
        restore_tensorboard(tmp_path, tree, str(tmp_path / "tb"))


def test_wandb_resume_into_another_run_warns_naming_both_runs(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from fastai.callback.wandb import WandbCallback

    from fastai_resume import trackers

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="frk", id="another-run", dir=str(tmp_path), mode="offline")
    try:
        cb = WandbCallback(log_preds=False)
        cb.run = True  # as its before_fit sets it in a fit on rank 0
        with pytest.warns(UserWarning, match="wandb.init\\(id='checkpointed-run', resume='allow'") as rec:
            trackers.load_wandb(cb, {"step": 55, "epoch": 1.2, "run_id": "checkpointed-run"})
        assert "'another-run'" in str(rec[0].message)
        assert (cb._wandb_step, cb._wandb_epoch) == (55, 1.2)
    finally:
        run.finish()


@pytest.fixture(scope="module")
def wandb_offline_runs(tmp_path_factory):
    pytest.importorskip("wandb")
    return runs_of("wandb", tmp_path_factory)


@pytest.mark.slow
def test_wandb_offline_resumed_run_logs_the_uninterrupted_steps_and_values(wandb_offline_runs):
    ref, res, _ = wandb_offline_runs
    (ref_run,) = wandb_runs(ref)
    _, resumed = wandb_runs(res)
    want, got = wandb_history(ref_run), wandb_history(resumed)
    assert sorted(want) == list(range(EPOCHS * N_ITER))  # fastai logs batch n at step n - 1
    assert sorted(got) == list(range(STEP_SAVED, EPOCHS * N_ITER)), (
        "the resumed run does not continue at the checkpoint's step"
    )
    assert got == {s: want[s] for s in got}


@pytest.mark.slow
def test_wandb_offline_killed_run_logged_the_uninterrupted_values(wandb_offline_runs):
    """What the killed run's file holds is the uninterrupted run's. (W&B writes its offline file
    every 15 s, `x_transaction_log_flush_interval`: a SIGKILL loses what it logged since.)"""
    ref, res, _ = wandb_offline_runs
    (ref_run,) = wandb_runs(ref)
    killed, _ = wandb_runs(res)
    want, got = wandb_history(ref_run), wandb_history(killed)
    assert got and sorted(got) == list(range(len(got))) and len(got) <= STEP_DIED
    assert got == {s: want[s] for s in got}


@pytest.mark.slow
def test_wandb_negative_control_without_the_state_the_resumed_run_restarts_at_step_0(wandb_offline_runs):
    ref, _, control = wandb_offline_runs
    _, resumed = wandb_runs(control)
    assert min(wandb_history(resumed)) == 0


@pytest.mark.slow
def test_wandb_offline_resumed_run_is_the_same_run_id(wandb_offline_runs):
    _, res, _ = wandb_offline_runs
    killed, resumed = wandb_runs(res)
    assert killed.endswith(WANDB_ID) and resumed.endswith(WANDB_ID)


if __name__ == "__main__":
    main()


def test_a_rerun_whose_default_tensorboard_dir_is_the_crashed_runs_leaves_one_file_of_its_own(tmp_path):
    "fastai names its default log dir by the second a fit starts: a rerun may get the crashed run's."
    pytest.importorskip("tensorboard")
    from fastai.callback.tensorboard import TensorBoardCallback
    from torch.utils.tensorboard import SummaryWriter

    from fastai_resume import trackers

    d = tmp_path / "runs" / "Dec04_19-32-20_vm"
    crashed = SummaryWriter(log_dir=str(d))
    crashed.add_scalar("train_loss", 1.0, 1)
    crashed.close()
    cb = TensorBoardCallback(trace_model=False, log_preds=False)  # log_dir=None: fastai's default
    cb.run, cb.writer = True, SummaryWriter(log_dir=str(d))  # what its before_fit opened, same name
    trackers.load_tensorboard(cb, {"log_dir": str(d), "step": 1})
    cb.writer.add_scalar("train_loss", 2.0, 2)
    cb.writer.close()
    assert len(glob.glob(str(d / "events.out.tfevents.*"))) == 2  # the crashed run's and the rerun's
    assert sorted(tensorboard_scalars(d)["train_loss"]) == [(1, 1.0), (2, 2.0)]  # (files in any order)
