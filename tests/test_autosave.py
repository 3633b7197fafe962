"""AutoCheckpoint: SIGKILL at random moments (inside saves too) and autoresume until done ends
bitwise equal to the uninterrupted run; SIGTERM saves and exits; retention; a full disk."""

import os
import random
import signal
import subprocess
import threading
import warnings
from pathlib import Path

import pytest
from procs import ENV, FORKS, N_ITER, assert_same_run, reference, run, start, trainer_cmd, wait_for_line
from trainer import build

import fastai_resume as fr

STATE = ("--epochs", "2", "--ballast-mb", "8")  # a bigger state: saves take long enough to be hit
AUTO = STATE + ("--auto", "4", "--slow-ms", "10")


def loadable(folder):
    out = []
    for p in sorted(folder.glob("auto-*.frk")):
        try:
            fr.load(p)
            out.append(p)
        except fr.CheckpointError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(8))  # up to 4 kills each, from the imports to the end of the fit
def test_random_sigkills_with_autoresume_end_bitwise_equal(tmp_root, tmp_path, trial):
    ref = reference(tmp_root, *STATE)
    rng = random.Random(trial)
    models = tmp_path / "models"
    kills, had_checkpoint = 0, False
    while True:
        p = subprocess.Popen(
            trainer_cmd(tmp_path, tmp_path / "out.frk", *AUTO),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = p.communicate(timeout=rng.uniform(3.0, 8.0) if kills < 4 else 600)
            assert p.returncode == 0, out
            break
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            kills += 1
        good = loadable(models) if models.exists() else []
        assert good or not had_checkpoint, "a kill left no loadable checkpoint"
        had_checkpoint |= bool(good)
    assert_same_run(ref, fr.load(tmp_path / "out.frk"), epochs=2)
    assert not list(models.glob(".*tmp*")), "a killed save's temporary file was left behind"
    assert len([p for p in models.glob("auto-*.frk") if not p.name.endswith("-end.frk")]) == 2  # keep=2


@pytest.mark.slow
def test_sigterm_saves_at_the_current_batch_and_exits_then_resumes_exactly(tmp_root, tmp_path):
    ref = reference(tmp_root)
    args = ("--auto", "100000", "--slow-ms", "30")
    p = start(trainer_cmd(tmp_path, tmp_path / "out.frk", *args))
    seen = wait_for_line(p, "[0, ")  # epoch 0's row is printed: training is in epoch 1 now, however slow the start
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    out = "".join(seen) + out
    assert p.returncode == fr.PREEMPTED_EXIT_CODE, out
    assert "SIGTERM: saved auto-" in out
    saved = [f for f in (tmp_path / "models").glob("auto-*.frk")]
    pos = fr.load(saved[-1])["train"]["position"]
    assert 0 < pos["epoch"] * N_ITER + pos["iter"] < 3 * N_ITER and pos["iter"] > 0  # mid-epoch
    log = run(tmp_path, tmp_path / "out.frk", *args)
    assert f"iteration {pos['iter']}/{N_ITER}" in log
    assert_same_run(ref, fr.load(tmp_path / "out.frk"))


def test_retention_keeps_newest_k_and_skips_a_corrupt_newest(tmp_path):
    cb = fr.AutoCheckpoint(every_iters=10, keep=3, background=False, every_epoch=False)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(2, 1e-2)
    names = [p.name for p in cb.checkpoints()]
    assert names == [f"auto-{cb.run_id}-g000-s000-f00-e000001-i00000000{i}.frk" for i in (24, 34, 44)]
    newest = cb.checkpoints()[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    cb2 = fr.AutoCheckpoint(every_iters=10, keep=1, background=False, every_epoch=False)
    learn2 = build(tmp_path, noise=False, extra_cbs=[cb2])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with learn2.no_bar(), learn2.no_logging():
            learn2.fit_one_cycle(2, 1e-2)
    assert any(newest.name in str(x.message) for x in w)
    assert len(learn2.recorder.losses) == 2 * N_ITER
    assert [p.name for p in cb2.checkpoints()] == [names[-1]]  # re-made, verified
    fr.load(cb2.checkpoints()[0])


def test_a_kill_between_the_last_commit_and_its_retention_is_trimmed_at_autoresume(tmp_path):
    "The run died after committing its final checkpoint and before removing the oldest one."
    cb = fr.AutoCheckpoint(every_iters=20, keep=2, background=False)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    kept = [p.name for p in cb.checkpoints()]
    assert kept == [
        f"auto-{cb.run_id}-g000-s000-f00-e000000-i0000000040.frk",
        f"auto-{cb.run_id}-g000-s000-f00-e000001-i0000000000.frk",
    ]
    stale = cb.folder / kept[0].replace("i0000000040", "i0000000020")  # what retention would have removed
    stale.write_bytes((cb.folder / kept[0]).read_bytes())
    cb2 = fr.AutoCheckpoint(every_iters=20, keep=2, background=False)
    learn2 = build(tmp_path, noise=False, extra_cbs=[cb2])
    with learn2.no_bar(), learn2.no_logging():
        learn2.fit(1, 1e-3)  # resumes at the end: nothing to save
    assert [p.name for p in cb2.checkpoints()] == kept


def test_background_saves_retire_old_checkpoints_in_their_writer_thread(tmp_path, monkeypatch):
    """Unlinking a big file takes tens of milliseconds: a background save removes the checkpoints
    retention retires from its writer thread, after its commit; one it cannot remove is still named
    in a warning, given in the training thread."""
    cb = fr.AutoCheckpoint(every_iters=10, keep=2, every_epoch=False)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    old = cb.checkpoints()
    assert len(old) == 2
    old[0].unlink()
    old[0].mkdir()  # a name of this run that unlink cannot remove (EISDIR)
    calls = []
    real_unlink = Path.unlink

    def unlink(self, *a, **k):
        calls.append((self.name, threading.current_thread().name))
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", unlink)
    cb2 = fr.AutoCheckpoint(every_iters=10, keep=2, every_epoch=False, resume=False)
    learn2 = build(tmp_path, noise=False, extra_cbs=[cb2])
    given = []  # (message, the thread that gave it)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *a, **k: given.append((str(msg), threading.current_thread().name))
        with learn2.no_bar(), learn2.no_logging():
            learn2.fit(1, 1e-3)
    assert cb2.run_id == cb.run_id
    retired = [(n, t) for n, t in calls if n.startswith(f"auto-{cb.run_id}-") and n.endswith(".frk")]
    assert old[1].name in {n for n, _ in retired} and not old[1].exists()
    assert {t for _, t in retired} == {"fastai_resume-commit"}  # never the training thread
    kept = cb2.checkpoints()
    assert kept[0] == old[0] and kept[0].is_dir() and len(kept) == 3  # the newest 2, and what could not go
    assert [p.name for p in kept[1:]] == [p.name for p in cb2.saved[-2:]]
    blocked = [t for m, t in given if f"could not remove {old[0]}" in m]
    assert blocked and set(blocked) == {"MainThread"}  # one per commit, each given in the training thread
    fr.load(kept[-1])


def test_no_checkpoint_starts_from_the_beginning(tmp_path):
    cb = fr.AutoCheckpoint(every_iters=20, keep=2)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    assert len(learn.recorder.losses) == N_ITER and len(cb.checkpoints()) == 2


def test_full_disk_during_autosave_is_a_clear_error_and_keeps_previous_checkpoints(tmp_path):
    run(tmp_path, tmp_path / "a.frk", "--auto", "20", "--auto-sync", "--epochs", "3")
    before = {p.name: p.read_bytes() for p in (tmp_path / "models").glob("auto-*.frk") if "-end" not in p.name}
    assert len(before) == 2
    for p in [tmp_path / "models" / n for n in before]:  # make the next saves bigger than the limit
        os.rename(p, p.with_name(p.name.replace("auto-", "old-")))
    proc = FORKS.run(
        trainer_cmd(tmp_path, tmp_path / "b.frk", "--auto", "5", "--ballast-mb", "8", "--fsize-mb", "4"), ENV, 600
    )
    assert proc.returncode != 0
    assert "background save of" in proc.stderr and "File too large" in proc.stderr
    assert "The previous checkpoints are intact" in proc.stderr
    after = {p.name.replace("old-", "auto-"): p.read_bytes() for p in (tmp_path / "models").glob("old-*.frk")}
    assert after == before
    assert not list((tmp_path / "models").glob(".*tmp*"))
