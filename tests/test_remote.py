"""Checkpoints mirrored to object storage: a real S3-API server (moto's, its own process, spoken to over HTTP
by s3fs, tests/s3server.py) and a file:// mirror in another folder (a network file system's case).

A lost machine is a killed training process whose whole local folder is then deleted; the unchanged
script rerun in another folder resumes from the remote and ends bitwise equal to the uninterrupted run.
Also: an upload killed midway, a server outage during training, a corrupted remote object, wrong
credentials, a second machine on the same run, and what `remote=` says without its packages."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from procs import ENV, FORKS, assert_same_result, assert_same_run, reference, trainer_cmd, workload_reference
from s3server import Proxy, Server

import fastai_resume as fr
from fastai_resume import objstore, remote

STATE = ("--epochs", "2", "--ballast-mb", "8")
AUTO = (*STATE, "--auto", "4", "--slow-ms", "50")  # a mid-epoch upload lands well before the epoch ends
NAME = re.compile(r"auto-\w+-g(\d{3})-s(\d{3})-f\d{2}-e(\d{6})-i(\d{10})\.frk$")


@pytest.fixture(scope="module")
def s3():
    server = Server()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3, tmp_path):
    "A new bucket on the module's server, for one test."
    name = "b" + re.sub(r"[^a-z0-9]", "", tmp_path.name.lower())[-40:] + str(os.getpid())
    s3.fs().mkdir(name)
    return name


def env_of(server, endpoint=None, **override):
    return dict(ENV, **server.env(endpoint, **override))


class Run:
    "tests/trainer.py (or another command) as a process whose output is read as it comes."

    def __init__(self, cmd, env):
        self.p = subprocess.Popen(
            cmd, env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True)
        self.reader.start()

    @property
    def out(self):
        return "".join(self.lines)

    def wait_for(self, cond, timeout=300, what="the condition"):
        t0 = time.monotonic()
        while not cond():
            assert self.p.poll() is None, f"the run ended (status {self.p.returncode}) before {what}:\n{self.out}"
            assert time.monotonic() - t0 < timeout, f"no {what} after {timeout} s:\n{self.out}"
            time.sleep(0.05)

    def kill(self):
        self.p.kill()
        self.p.wait()
        self.reader.join(30)
        assert self.p.returncode == -signal.SIGKILL, self.out

    def finish(self, timeout=600):
        self.p.wait(timeout)
        self.reader.join(30)
        return self.p.returncode


def complete(ls) -> list:
    "The names of the checkpoints complete in a remote folder's listing (data and marker), oldest first."
    names = {os.path.basename(n.rstrip("/")) for n in ls}
    return sorted(n for n in names if NAME.match(n) and n + ".done" in names)


def position(name):
    g, s, e, i = NAME.match(name).groups()
    return int(e), int(i)


def run_trainer(path, out, *args, env=ENV):
    p = FORKS.run(trainer_cmd(path, out, *args), env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


class Mirror:
    "The test's own view of a remote folder (a URL): its listing and its objects."

    def __init__(self, url, fs):
        self.url, self.fs = url, fs
        self.root = objstore.filesystem(url)[1] if fs is None else url.split("://", 1)[1].rstrip("/")
        if fs is None:
            self.fs = objstore.filesystem(url)[0]

    def ls(self):
        try:
            return [os.path.basename(x) for x in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def complete(self):
        return complete(self.ls())


def mirror_of(kind, tmp_path, s3, bucket):
    if kind == "s3":
        return Mirror(f"s3://{bucket}/run/", s3.fs()), env_of(s3)
    folder = tmp_path / "network-fs" / "run"
    return Mirror(folder.as_uri() + "/", None), ENV


def killed_mid_epoch(tmp_path, mirror, env, machine="machine1"):
    """Trains tests/trainer.py with the remote until the remote holds a checkpoint from the middle of the
    second epoch, kills it (SIGKILL), deletes its whole folder: the lost machine. Returns the newest
    checkpoint complete on the remote then."""
    folder = tmp_path / machine
    r = Run(trainer_cmd(folder, folder / "out.frk", *AUTO, "--remote", mirror.url), env)
    r.wait_for(lambda: any(position(n)[0] == 1 and position(n)[1] > 0 for n in mirror.complete()), what="an upload")
    r.kill()
    shutil.rmtree(folder)
    return mirror.complete()[-1], r.out


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_lost_machine_resumes_from_the_remote_and_ends_bitwise_equal(tmp_root, tmp_path, kind, request):
    """Killed mid-epoch, its local folder deleted, the unchanged script rerun in another folder: it downloads
    the remote's newest checkpoint, says so, trains only what was left, and ends as the uninterrupted run.
    Negative control: the same rerun with an empty remote starts over (and trains every batch again)."""
    s3, bucket = (request.getfixturevalue("s3"), request.getfixturevalue("bucket")) if kind == "s3" else (None, None)
    mirror, env = mirror_of(kind, tmp_path, s3, bucket)
    ref = reference(tmp_root, *STATE)
    newest, _ = killed_mid_epoch(tmp_path, mirror, env)
    epoch, it = position(newest)
    m2 = tmp_path / "machine2"
    log = run_trainer(m2, m2 / "out.frk", *AUTO, "--remote", mirror.url, env=env)
    assert f"AutoCheckpoint: downloaded {newest} from {mirror.url}" in log, log
    assert "checksums verified" in log and f"AutoCheckpoint: found {newest}" in log, log
    res = fr.load(m2 / "out.frk")
    assert sorted(res["seen"]) == [str(e) for e in range(epoch, 2)]  # only what was left was trained here
    assert len(res["seen"][str(epoch)]) == 1500 - it * 32  # its items but those of the batches trained before
    assert_same_run(ref, res, epochs=2)
    assert mirror.complete()[-1].endswith("-e000002-i0000000000.frk")  # the run's end is on the remote too
    assert len(mirror.complete()) == 2  # keep=2 there as here

    empty = Mirror(mirror.url.rstrip("/") + "-empty/", mirror.fs if kind == "s3" else None)
    m3 = tmp_path / "machine3"
    log = run_trainer(m3, m3 / "out.frk", *AUTO, "--remote", empty.url, env=env)
    assert "downloaded" not in log and sorted(fr.load(m3 / "out.frk")["seen"]) == ["0", "1"]  # started over


@pytest.mark.slow
def test_stage_end_files_are_mirrored_and_a_new_machine_restores_the_stages_it_skips(tmp_root, tmp_path, s3, bucket):
    """A three-stage script (lr_find, fit_one_cycle, freeze_to, fit_one_cycle, unfreeze, fit_one_cycle)
    killed in its last stage once the remote has that stage's checkpoint; the rerun on an empty folder
    downloads it with the two stage-end files it names, restores the stages it skips from them and ends
    as the uninterrupted run. (The script's CSV log, a file of its own in learn.path, is lost with the
    machine: it is no checkpoint.) Negative control: with the stage-end objects gone from the remote,
    the rerun says so and restores no stage."""
    args = ("--recipe", "stages", "--auto", "4")
    ref = workload_reference(tmp_root, "digits", *args)
    url = f"s3://{bucket}/run/"
    env, fs = env_of(s3), s3.fs()

    def lost_machine_then_rerun(tag):
        m1, m2 = tmp_path / f"{tag}1", tmp_path / f"{tag}2"
        for m in (m1, m2):
            m.mkdir()
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "workloads.py"), "digits"]
        p = FORKS.run(
            [*cmd, "--path", str(m1), "--out", str(m1 / "dead.frk"), *args, "--remote", url, "--die", "2,0,6"], env, 600
        )
        assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
        shutil.rmtree(m1)
        return m2, cmd

    m2, cmd = lost_machine_then_rerun("a")
    ends = [n for n in fs.ls(f"{bucket}/run", detail=False) if "-end.frk.t" in n]
    assert len(ends) == 2, ends  # stage 0's and stage 1's, under their tokens
    p = FORKS.run([*cmd, "--path", str(m2), "--out", str(m2 / "out.frk"), *args, "--remote", url], env, 600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "and 2 stage-end files" in log and log.count("restored as it ended") == 2
    assert_same_result(ref, fr.load(m2 / "out.frk"), ("model", "opt", "losses", "lrs", "values", "rng"))

    url = f"s3://{bucket}/control/"
    m2, cmd = lost_machine_then_rerun("b")
    for n in fs.ls(f"{bucket}/control", detail=False):
        if "-end.frk.t" in n:
            fs.rm(n)
    p = FORKS.run([*cmd, "--path", str(m2), "--out", str(m2 / "out.frk"), *args, "--remote", url], env, 600)
    log = p.stdout + p.stderr
    assert "lacks the stage-end file(s)" in log and "restored as it ended" not in log


@pytest.mark.slow
def test_an_upload_killed_midway_leaves_the_previous_complete_checkpoint(tmp_root, tmp_path, s3, bucket):
    """A 100 MB checkpoint goes up in 16 MB parts: killed while one is in flight, the remote has no object
    of it (a multipart upload is never an object until completed), its previous checkpoints verify, and a
    new machine resumes from the newest of them exactly."""
    state = ("--epochs", "2", "--ballast-mb", "96")
    args = (*state, "--auto", "23", "--slow-ms", "20")
    ref = reference(tmp_root, *state)
    url, env, fs = f"s3://{bucket}/run/", env_of(s3), s3.fs()
    mirror = Mirror(url, fs)
    m1 = tmp_path / "machine1"
    r = Run(trainer_cmd(m1, m1 / "out.frk", *args, "--remote", url), env)
    r.wait_for(lambda: mirror.complete() and s3.multipart_uploads(bucket), what="an upload in flight after one done")
    r.kill()
    names = mirror.ls()
    inflight = s3.multipart_uploads(bucket)
    assert inflight and all(u["Key"].split("/")[-1] not in names for u in inflight)
    done = mirror.complete()
    assert all(n in done or n.endswith(".done") or n.startswith(".") or "-end.frk" in n for n in names), names
    shutil.rmtree(m1)
    p = subprocess.run([sys.executable, "-m", "fastai_resume", "verify", url], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and f"{len(done)} ok, 0 bad" in p.stdout, p.stdout + p.stderr
    m2 = tmp_path / "machine2"
    log = run_trainer(m2, m2 / "out.frk", *args, "--remote", url, env=env)
    assert f"AutoCheckpoint: downloaded {done[-1]}" in log
    assert_same_run(ref, fr.load(m2 / "out.frk"), epochs=2)


@pytest.mark.slow
def test_a_server_outage_during_training_is_said_survived_and_caught_up(tmp_root, tmp_path, s3, bucket):
    """The server becomes unreachable during training (the relay in front of it is killed) and comes back:
    training goes on and ends as the uninterrupted run, local checkpoints keep being written, a warning
    says how far behind the remote is, uploads retry, and the remote ends with the run's last checkpoint."""
    proxy = Proxy(s3.port)
    try:
        url, env = f"s3://{bucket}/run/", env_of(s3, proxy.endpoint)
        mirror = Mirror(url, s3.fs())
        m1 = tmp_path / "machine1"
        r = Run(trainer_cmd(m1, m1 / "out.frk", "--auto", "4", "--slow-ms", "100", "--remote", url), env)
        # a first checkpoint complete there and an object of a newer one: its uploader had the first's answer
        # (the relay killed between the server's write of a marker and its answer leaves the uploader unsure)
        r.wait_for(
            lambda: (done := mirror.complete()) and any(n > done[0] for n in mirror.ls() if n.endswith(".frk")),
            what="a first upload and a next one",
        )
        proxy.stop()
        stopped = len(list((m1 / "models").glob("auto-*-i*.frk")))
        r.wait_for(lambda: "checkpoints behind" in r.out or "checkpoint behind" in r.out, what="the warning")
        proxy.start()
        assert r.finish() == 0, r.out
    finally:
        proxy.stop()
    out = r.out
    behind = re.search(
        r"AutoCheckpoint: the remote \S+ is (\d+) checkpoints? behind \(its newest checkpoint is (\S+);", out
    )
    assert behind, out
    assert "Training goes on and local checkpoints are written" in out
    assert re.search(r"AutoCheckpoint: the remote \S+ is up to date again", out) or "is on s3://" in out, out
    assert stopped >= 1 and len(list((m1 / "models").glob("auto-*-i*.frk"))) >= 1
    last = sorted(n.name for n in (m1 / "models").glob("auto-*.frk") if NAME.match(n.name))[-1]
    assert mirror.complete()[-1] == last  # caught up
    assert_same_run(reference(tmp_root), fr.load(m1 / "out.frk"))


@pytest.mark.slow
def test_a_corrupted_remote_object_is_set_aside_and_the_previous_one_resumes(
    tmp_root, tmp_path, s3, bucket, monkeypatch
):
    """One byte of the newest remote checkpoint flipped: `verify URL` says BAD (OK for the other, SKIP for
    the markers and lock), a new machine names it in a warning, sets it aside (NAME.corrupt) and resumes
    from the previous one, exactly; `inspect URL` and `learn.load(URL)` read a remote file."""
    ref = reference(tmp_root, *STATE)
    url, env, fs = f"s3://{bucket}/run/", env_of(s3), s3.fs()
    mirror = Mirror(url, fs)
    m1 = tmp_path / "machine1"
    run_trainer(m1, m1 / "out.frk", *AUTO, "--remote", url, env=env)
    older, newest = mirror.complete()
    data = bytearray(fs.cat_file(f"{bucket}/run/{newest}"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{bucket}/run/{newest}", bytes(data))
    shutil.rmtree(m1)

    cli = [sys.executable, "-m", "fastai_resume"]
    p = subprocess.run([*cli, "verify", url], env=env, capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"OK   {url}{older}\n" in p.stdout and f"BAD  {url}{newest}: " in p.stdout
    assert "differs from what was uploaded" in p.stdout and "2 ok" not in p.stdout
    assert f"SKIP {url}{older}.done: the marker of {older}" in p.stdout
    p = subprocess.run([*cli, "inspect", "--brief", url + older], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith(f"{url}{older}: fastai_resume format"), p.stdout + p.stderr

    import torch
    from trainer import build

    # before machine 2 runs: its retention may remove `older` from the remote
    m3 = tmp_path / "machine3"
    learn = build(m3, noise=True)
    learn.model.register_buffer("ballast", torch.ones(8 << 18))  # as tests/trainer.py --ballast-mb 8
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)  # as a user's shell sets them
    learn.load(url + older)
    armed = fr.script.script(learn).armed
    assert armed is not None and armed.path == m3 / "models" / older
    pos = armed.train["position"]
    assert (pos["epoch"], pos["iter"]) == position(older)
    (m3 / "models" / older).write_bytes(b"another file")
    with pytest.raises(FileExistsError, match="exists and differs from the remote file; move it away first"):
        learn.load(url + older)

    m2 = tmp_path / "machine2"
    log = run_trainer(m2, m2 / "out.frk", *AUTO, "--remote", url, env=env)
    assert re.search(rf"AutoCheckpoint: skipping {re.escape(url + newest)}: .*differs from what was uploaded", log), log
    assert f"AutoCheckpoint: downloaded {older} from {url}" in log
    assert newest + ".corrupt" in mirror.ls() or newest in mirror.complete()  # set aside, then saved again
    assert_same_run(ref, fr.load(m2 / "out.frk"), epochs=2)


def test_a_sigterm_saves_and_the_exit_waits_for_that_checkpoints_upload(tmp_root, tmp_path):
    """Preemption: SIGTERM mid-epoch saves a checkpoint at the current batch, and the process exits (143) only
    once that checkpoint is complete on the remote; a new machine resumes from it exactly."""
    mirror = Mirror((tmp_path / "network-fs" / "run").as_uri() + "/", None)
    m1 = tmp_path / "machine1"
    args = ("--auto", "100000", "--slow-ms", "30", "--remote", mirror.url)
    r = Run(trainer_cmd(m1, m1 / "out.frk", *args), ENV)
    r.wait_for(lambda: "[0, " in r.out, what="epoch 0's row")
    r.p.send_signal(signal.SIGTERM)
    assert r.finish() == fr.PREEMPTED_EXIT_CODE, r.out
    saved = re.search(r"AutoCheckpoint: SIGTERM: saved (\S+),", r.out)[1]
    assert f"AutoCheckpoint: {saved} is on {mirror.url}" in r.out
    assert mirror.complete()[-1] == saved and position(saved)[1] > 0
    shutil.rmtree(m1)
    m2 = tmp_path / "machine2"
    log = run_trainer(m2, m2 / "out.frk", *args)
    assert f"AutoCheckpoint: downloaded {saved}" in log
    assert_same_run(reference(tmp_root), fr.load(m2 / "out.frk"))


def test_an_incomplete_upload_on_a_file_mirror_is_skipped_then_removed(tmp_path):
    """What an upload killed midway leaves on a file:// mirror (the data without its marker) is never a
    checkpoint: `verify` skips it saying why, a resume takes the complete one, and the next start removes it."""
    import torch

    local, folder = tmp_path / "machine", tmp_path / "nfs" / "run"
    local.mkdir()
    url = folder.as_uri() + "/"
    m = remote.Mirror(url, None, local, "auto", "r1", 2, 10)
    m.open()
    done = local / "auto-r1-g000-s000-f00-e000000-i0000000004.frk"
    fr.save({"fastai_resume": 1, "model": {"w": torch.ones(4)}}, done)
    m._mirror(done)
    m.close()
    half = folder / "auto-r1-g000-s000-f00-e000000-i0000000008.frk"
    half.write_bytes(done.read_bytes()[:100])  # a killed upload's data: no marker
    p = subprocess.run([sys.executable, "-m", "fastai_resume", "verify", url], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SKIP {url}{half.name}: an upload without its marker" in p.stdout and "1 ok, 0 bad, 2 skipped" in p.stdout
    shutil.rmtree(local)
    local.mkdir()
    m2 = remote.Mirror(url, None, local, "auto", "r1", 2, 10)
    m2.open()
    try:
        assert not half.exists()  # removed at the start
        got = m2.resume_point(None)
        assert got == local / done.name and fr.load(got)["model"]["w"].sum() == 4
    finally:
        m2.close()
    assert not (folder / ".auto-r1.lock").exists()  # released at the end


@pytest.mark.slow
def test_a_second_machine_on_the_same_run_is_refused(tmp_path, s3, bucket):
    "Two processes mirroring one run to one remote from two folders: the second is refused before it trains."
    url, env = f"s3://{bucket}/run/", env_of(s3)
    a = Run(trainer_cmd(tmp_path / "a", tmp_path / "a.frk", "--auto", "4", "--slow-ms", "300", "--remote", url), env)
    try:
        a.wait_for(lambda: list((tmp_path / "a" / "models").glob("auto-*.frk")), what="a checkpoint")
        log = subprocess.run(
            trainer_cmd(tmp_path / "b", tmp_path / "b.frk", "--auto", "4", "--remote", url),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert log.returncode != 0
        assert "is already mirroring this run to " + url in log.stderr and "[0, " not in log.stdout
        assert not list((tmp_path / "b" / "models").glob("auto-*.frk"))
        assert a.p.poll() is None  # the first one trains on
    finally:
        a.p.kill()
        a.finish()


def test_a_lock_renewed_by_another_machine_is_refused_and_a_lapsed_one_taken_over(tmp_path, s3, bucket, monkeypatch):
    """The lease of a process on another machine: refused while it is renewed; once it stops (a lost
    machine), taken over after four of the renewal periods it declared."""
    fs = s3.fs()
    key = f"{bucket}/run/.auto-r2.lock"
    body = {"token": "other", "pid": 1, "machine": "other-host 0 0", "beat": 0, "renew_seconds": 0.5}
    fs.pipe_file(key, json.dumps(body).encode())
    stop = threading.Event()

    def renew():
        while not stop.wait(0.3):
            body["beat"] += 1
            fs.pipe_file(key, json.dumps(body).encode())

    t = threading.Thread(target=renew)
    t.start()
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(RuntimeError, match="renewed the lock .auto-r2.lock just now"):
            remote.Mirror(f"s3://{bucket}/run/", None, tmp_path, "auto", "r2", 2, 10).open()
    finally:
        stop.set()
        t.join()
    m = remote.Mirror(f"s3://{bucket}/run/", None, tmp_path, "auto", "r2", 2, 10)
    t0 = time.monotonic()
    m.open()
    try:
        assert 2.0 <= time.monotonic() - t0 < 30
        assert json.loads(fs.cat_file(key))["token"] == m.token
    finally:
        m.close()


def test_a_lease_taken_by_another_machine_is_said_once_and_this_one_stops_mirroring(tmp_path, s3, bucket, monkeypatch):
    """The renewals and the uploads both check the lease: once another machine holds it, one notice says so
    (not one per thread that found out), and this process writes no more there (nor removes the other's lock)."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(remote, "RENEW", 0.2)
    fs, key = s3.fs(), f"{bucket}/run/.auto-r3.lock"
    m = remote.Mirror(f"s3://{bucket}/run/", None, tmp_path, "auto", "r3", 2, 10)
    m.open()
    try:
        other = {"token": "other", "pid": 1, "machine": "other-host 0 0", "beat": 0, "renew_seconds": 15}
        fs.pipe_file(key, json.dumps(other).encode())
        deadline = time.monotonic() + 30
        while m.lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(remote._Lost):
            m.lease.fence()  # an upload under way meets it too
        ckpt = tmp_path / "auto-r3-g001-s000-f00-e000000-i0000000001.frk"
        fr.save({"w": list(range(8))}, ckpt)
        with pytest.warns(UserWarning) as said:
            m.committed(ckpt)  # said in the training thread, at its next checkpoint
        time.sleep(1.0)
        said = [str(w.message) for w in said if "is held by" in str(w.message)]
        assert len(said) == 1 and "other-host" in said[0] and "no longer mirrors the run" in said[0]
    finally:
        m.close()
    assert json.loads(fs.cat_file(key))["token"] == "other"
    assert not [k for k in fs.ls(f"{bucket}/run/") if k.endswith(".frk")]  # nothing uploaded once lost


def test_wrong_credentials_are_a_clear_error_before_training(tmp_path):
    """A server that checks credentials: a wrong secret stops the script at its first training call with one
    line that says so, before any batch; the right keys train (the positive control)."""
    server = Server(auth=True)
    try:
        server.fs().mkdir("runs")
        url = "s3://runs/run/"
        t0 = time.monotonic()
        p = FORKS.run(
            trainer_cmd(tmp_path / "a", tmp_path / "a.frk", "--epochs", "1", "--auto", "4", "--remote", url),
            env=dict(ENV, **server.env(AWS_SECRET_ACCESS_KEY="wrong")),
            timeout=300,
        )
        assert p.returncode != 0 and time.monotonic() - t0 < 180  # the start of a process, not hours
        last = p.stderr.strip().splitlines()[-1]
        assert "AutoCheckpoint: the remote s3://runs/run/ refused the credentials" in last, p.stderr
        assert "Training has not started" in last and "[0, " not in p.stdout
        p = FORKS.run(
            trainer_cmd(tmp_path / "b", tmp_path / "b.frk", "--epochs", "1", "--auto", "20", "--remote", url),
            env=dict(ENV, **server.env()),
            timeout=300,
        )
        assert p.returncode == 0 and "is on s3://runs/run/" in p.stdout, p.stdout + p.stderr
    finally:
        server.stop()


def test_a_missing_bucket_is_a_clear_error_at_the_start(tmp_path, s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(objstore.RemoteError, match=r"the remote s3://no-such-bucket/run/ does not exist .*create the"):
        remote.Mirror("s3://no-such-bucket/run/", None, tmp_path, "auto", "r3", 2, 10).open()


@pytest.mark.parametrize("missing, says", [("fsspec", "needs fsspec"), ("s3fs", "needs s3fs")])
def test_without_the_optional_packages_remote_says_in_one_line_what_to_install(missing, says):
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "import fastai.learner, fastai_resume\n"
        "fastai_resume.AutoCheckpoint(remote='s3://bucket/run/')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("ImportError: a remote (s3://bucket/run/) " + says), p.stderr
    assert last.endswith("pip install 'fastai-resume[remote]'")


PUT_CHILD = r"""
import sys
from fastai_resume.objstore import put_whole, filesystem
fs, root = filesystem(sys.argv[1])
use_put = sys.argv[2] == "put_whole"
i = 0
print("ready", flush=True)
while True:
    i += 1
    data = bytes([i % 251]) * (4 << 20)  # every version is one byte repeated: a torn one mixes two or is short
    (put_whole(fs, root + "/m.done", data) if use_put else fs.pipe_file(root + "/m.done", data))
"""


@pytest.mark.parametrize("how", ["put_whole", "pipe_file"])
def test_a_marker_on_a_mounted_folder_is_whole_or_absent_whatever_moment_its_writer_is_killed(tmp_path, how):
    """On `file://` (a mounted network folder) a marker or lease was written in place: a process killed
    mid-write left it torn, and the rerun had to skip that checkpoint. `put_whole` writes a temporary name
    in the same folder and renames it over. Its writer, SIGKILLed at 20 moments, leaves a whole version
    each time; the control (fsspec's pipe_file, the old way) leaves a torn one at some of them."""
    folder = tmp_path / "mounted"
    folder.mkdir()
    torn = 0
    for k in range(20):
        p = subprocess.Popen([sys.executable, "-c", PUT_CHILD, folder.as_uri(), how], env=ENV, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        time.sleep(0.05 + 0.013 * k)
        p.kill()
        p.wait()
        p.stdout.close()
        data = (folder / "m.done").read_bytes() if (folder / "m.done").exists() else None
        torn += data is not None and (len(data) != 4 << 20 or data.count(data[:1]) != len(data))
    if how == "put_whole":
        assert torn == 0  # (a kill between the write and the rename leaves the temporary name beside it)
    else:
        assert torn > 0  # the control: the old way tears
