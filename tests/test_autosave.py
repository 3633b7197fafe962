"""AutoCheckpoint: SIGKILL at random moments (inside saves too) and autoresume until done ends
bitwise equal to the uninterrupted run; SIGTERM saves and exits; retention; a full disk."""

import errno
import os
import random
import re
import signal
import subprocess
import threading
import warnings
from pathlib import Path

import pytest
from procs import ENV, FORKS, N_ITER, assert_same_run, reference, run, start, tmpfs, trainer_cmd, wait_for_line
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


def test_a_dead_saves_whole_file_is_put_in_place_one_cut_short_removed_a_live_ones_left(tmp_path, capsys):
    """A save killed after its file was written whole, before it was put in place, leaves it under its temporary
    name: the next start verifies it, syncs it, puts it in place and says so (a SIGKILL loses at most the step
    in flight). One cut short is removed, never put in place, with the data log begun beside it; a live process's is not
    touched."""
    cb = fr.AutoCheckpoint(every_iters=20, keep=3, background=False, every_epoch=False)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    older, newest = cb.checkpoints()[-2:]
    data = newest.read_bytes()
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        whole = cb.folder / f".{newest.name}.tmp.{gone.pid}.a1"
        newest.rename(whole)
        cut = cb.folder / f".{older.name.replace('i0000000020', 'i0000000030')}.tmp.{gone.pid}.b2"
        cut.write_bytes(older.read_bytes()[:-100])
        cut_log = cb.folder / (cut.name[1:].split(".tmp.")[0] + ".datalog")  # a stream's log, begun beside it
        cut_log.write_text("0 30 0123\n")
        other = cb.folder / f".{older.name.replace('i0000000020', 'i0000000010')}.tmp.{live.pid}.c3"
        other.write_bytes(b"being written")
        cb2 = fr.AutoCheckpoint(every_iters=20, keep=3, background=False, every_epoch=False)
        learn2 = build(tmp_path, noise=False, extra_cbs=[cb2])
        with learn2.no_bar(), learn2.no_logging():
            learn2.fit(1, 1e-3)  # resumes from the one put in place
        out = capsys.readouterr().out
        assert f"AutoCheckpoint: {newest.name} was written whole by a process killed before putting it in place" in out
        assert newest.read_bytes() == data and not whole.exists()
        assert not cut.exists() and not (cb.folder / cut.name[1:].split(".tmp.")[0]).exists() and not cut_log.exists()
        assert other.read_bytes() == b"being written"
        assert re.search(rf"resuming .*{re.escape(newest.name)}.*at epoch 0, iteration 40/", out), out
    finally:
        live.kill()
        live.wait()


def test_background_saves_retire_old_checkpoints_in_their_writer_thread(tmp_path, monkeypatch):
    """Unlinking a big file takes tens of milliseconds: a background save removes the checkpoints
    retention retires from its writer thread, after its commit; one it cannot remove is still named
    in a warning, given in the training thread. (`background=True`: under the default, 'auto', a fit on
    the CPU puts a small checkpoint in place at the batch boundary, its retention with it.)"""
    cb = fr.AutoCheckpoint(every_iters=10, keep=2, every_epoch=False, background=True)
    learn = build(tmp_path, noise=False, extra_cbs=[cb])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    old = cb.checkpoints()
    assert len(old) == 2
    calls = []
    real_unlink = Path.unlink

    def unlink(self, *a, **k):
        calls.append((self.name, threading.current_thread().name))
        if self == old[0]:  # a file of this run that cannot be removed
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", unlink)
    cb2 = fr.AutoCheckpoint(every_iters=10, keep=2, every_epoch=False, resume=False, background=True)
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
    assert kept[0] == old[0] and kept[0].is_file() and len(kept) == 3  # the newest 2, and what could not go
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


# A checkpoint of tests/trainer.py with --ballast-mb 4 takes 4.38 MB: an 11 MiB disk holds two and
# a half, a 6 MiB disk one and a half.
FULL_DISK = ("--epochs", "2", "--auto", "5", "--ballast-mb", "4", "--show-warnings")
NOTICE = re.compile(
    r"AutoCheckpoint: the disk is full \(No space left on device\): (?P<name>\S+) needs (?P<needed>[\d,]+) bytes "
    r"\((?P<free>[\d,]+) free\) in (?P<folder>\S+); removed this run's older checkpoint (?P<removed>\S+) "
    r"\((?P<removed_bytes>[\d,]+) bytes\) to make room, and saves again (?P<then>now|at the next batch)$"
)


def _int(s):
    return int(s.replace(",", ""))


def left_on(models):
    "The run's checkpoints in `models` (each verified), their sizes, and any temporary file left there."
    files = sorted(models.glob("auto-*.frk"))
    for f in files:
        fr.info(f, verify=True)
    return files, [f.stat().st_size for f in files], list(models.glob(".*tmp*"))


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_a_full_disk_says_so_once_per_occurrence_with_the_room_needed_and_what_was_removed(tmp_path, mode):
    """keep=2 (tests/trainer.py's) on a real disk that holds two and a half checkpoints: every save after
    the second finds it full, removes this run's older checkpoint and saves again; each time a printed
    line says so (the environment ignores warnings, as a notebook's may) and a warning with the same
    words, naming the folder, the checkpoint's size and what was removed."""
    with tmpfs(tmp_path / "disk", "11m") as disk:
        out = run(disk, tmp_path / "out.frk", *FULL_DISK, *(("--auto-sync",) if mode == "sync" else ()))
        models = disk / "models"
        files, sizes, temps = left_on(models)
    lines = out.splitlines()
    printed = [ln for ln in lines if ln.startswith("AutoCheckpoint: the disk is full")]
    warned = [ln[len("WARNING: ") :] for ln in lines if ln.startswith("WARNING: AutoCheckpoint: the disk is full")]
    assert len(printed) >= 10, out  # ~18 saves, the first two fit
    assert printed == warned  # each occurrence: one printed line, one warning, the same words
    notices = [NOTICE.match(ln) for ln in printed]
    assert all(notices), printed
    assert len({m["name"] for m in notices}) == len(notices)  # no save announced twice
    for m in notices:
        assert m["folder"] == str(models)
        last = m["name"].endswith("-e000002-i0000000000.frk")  # the fit's last save is synchronous in both modes
        assert m["then"] == ("now" if mode == "sync" or last else "at the next batch")
        needed, free = _int(m["needed"]), _int(m["free"])
        assert needed > free and all(abs(needed - n) < 0.001 * n for n in sizes), (m[0], sizes)  # its size
        assert abs(_int(m["removed_bytes"]) - needed) < 0.001 * needed  # one checkpoint of this run
        assert m["removed"] != m["name"] and re.fullmatch(r"auto-\w+-g000-s000-f00-e\d{6}-i\d{10}\.frk", m["removed"])
        assert m["removed"] not in [p.name for p in files]
    # the fit's end was saved, and the run ends with the two newest checkpoints
    assert [p.name.split("-")[-2:] for p in files][-1] == ["e000002", "i0000000000.frk"] and len(files) == 2
    assert temps == []


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_a_full_disk_with_nothing_left_to_remove_is_an_error_that_says_what_to_do(tmp_path, mode):
    "A disk that holds one checkpoint and a half: the second save has nothing of this run's to remove."
    with tmpfs(tmp_path / "disk", "6m") as disk:
        p = FORKS.run(
            trainer_cmd(disk, tmp_path / "out.frk", *FULL_DISK, *(("--auto-sync",) if mode == "sync" else ())),
            ENV,
            600,
        )
        models = disk / "models"
        files, sizes, temps = left_on(models)
    assert p.returncode != 0, p.stdout
    assert len(files) == 1 and temps == []  # the first checkpoint is intact, nothing is left behind
    err = p.stderr.splitlines()[-1]
    m = re.fullmatch(
        r"OSError: \[Errno 28\] AutoCheckpoint: the disk is full \(No space left on device\): (\S+) needs ([\d,]+) "
        r"bytes \(([\d,]+) free\) in (\S+), and this run has nothing left to remove there \(its newest checkpoint "
        r"(\S+) stays; other files are never touched\)\. Free space on that disk, or give the Learner a path "
        r"\(or model_dir\) on a larger one, then run the script again: it resumes from (\S+)\. The previous "
        r"checkpoints are intact\.",
        err,
    )
    assert m, err
    name, needed, free, folder, kept, resumes = m.groups()
    assert folder == str(models) and kept == resumes == files[0].name and name > kept
    assert _int(needed) > _int(free) and abs(_int(needed) - sizes[0]) < 0.001 * _int(needed)
    assert "AutoCheckpoint: the disk is full" not in p.stdout  # nothing was removed: no notice of a retry


def test_the_lock_file_is_gone_when_the_script_ends(tmp_path):
    "A killed run leaves its lock file (the lock itself dies with it); the rerun takes it over, and removes it at its end."
    run(tmp_path, tmp_path / "a.frk", "--auto", "10", "--epochs", "1", "--die-at", "0,20", expect_kill=True)
    assert list((tmp_path / "models").glob(".auto-*.lock"))
    run(tmp_path, tmp_path / "b.frk", "--auto", "10", "--epochs", "1")
    assert not list((tmp_path / "models").glob(".auto-*.lock"))
