"""One run's lease on its remote folder (`.<fname>-<run>.lock`, `remote`): which process may write the run's
checkpoints there. Taken at the run's start, renewed by a thread every `RENEW` seconds, checked before each
write that removes or replaces a checkpoint's object; another process takes it over only once it has seen
it unchanged for 4 renewals (a lost machine's), or at once when it names a process of this machine that is
gone. What the background threads have to say waits in `Notices` for the training thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time

from . import stored
from .objstore import put_whole

__all__ = ["Lease", "Lost", "Notices", "RENEW", "machine"]

RENEW = 15.0  # seconds between two renewals of the run's lease


def machine() -> str:
    "This machine (and pid namespace): where a lock's process id can be looked up."
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, ns = "?", 0
    return f"{socket.gethostname()} {boot} {ns}"


class Lost(Exception):
    "Another process holds the run's lease: this mirror stops."


class Notices:
    "What the background threads have to say, kept to be said in the training thread (`Uploader.say_due`)."

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list = []

    def post(self, msg: str) -> None:
        with self.lock:
            self.pending.append(msg)

    def take(self) -> list:
        with self.lock:
            out, self.pending = self.pending, []
        return out


class Lease:
    """The run's lease on the remote (`.<fname>-<run>.lock`): taken at the start (`take`), renewed every
    `RENEW` seconds by a thread, checked (`fence`) before each write that removes or replaces a checkpoint's
    object, released at the end. `lost`: what to say once another process took it (this one mirrors no more).
    `run`: the run's folder on the remote (`remote.RemoteRun`: its `fs`, `url`, `key`)."""

    def __init__(self, run, fname: str, run_id: str, notices: Notices):
        self.fs, self.url = run.fs, run.url
        self.lock_name = f".{fname}-{run_id}.lock"
        self.path = run.key(self.lock_name)
        self.token = secrets.token_hex(8)
        self.notices = notices
        self.beat = 0
        self.lost: str | None = None
        self.lost_lock = threading.Lock()  # the renewals and the uploads both fence: `lost` is said once
        self.ended = threading.Event()  # the process's end, or the lease lost: no more renewals
        self.thread = threading.Thread(target=self._renew_loop, name="fastai_resume-remote", daemon=True)

    def read(self):
        try:
            raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            held = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return {"token": None, "raw": raw}
        return held if isinstance(held, dict) else {"token": None, "raw": raw}

    def write(self):
        self.beat += 1
        body = {
            "token": self.token,
            "pid": os.getpid(),
            "machine": machine(),
            "beat": self.beat,
            "renew_seconds": RENEW,
        }
        put_whole(self.fs, self.path, json.dumps(body).encode())

    def _holder(self, held) -> str:
        return f"process {held.get('pid')} on {str(held.get('machine', '?')).split(' ')[0]}"

    def take(self):
        held = self.read()
        if held is not None and held.get("token") != self.token:
            if held.get("machine") == machine():
                if stored.alive(held.get("pid")):
                    raise RuntimeError(
                        f"AutoCheckpoint: {self._holder(held)} is already mirroring this run to {self.url} (lock "
                        f"{self.lock_name}); two processes writing one run's checkpoints would delete each other's "
                        "files. Stop the other one, or give this one another fname or remote."
                    )
            else:
                renew = held.get("renew_seconds")
                renew = float(renew) if isinstance(renew, (int, float)) and 0 < renew <= 3600 else RENEW
                limit = 4 * renew
                print(
                    f"AutoCheckpoint: {self.url} is held by {self._holder(held)} (lock {self.lock_name}); waiting up "
                    f"to {limit:.0f} s to see whether it still renews it (a lost machine does not)",
                    flush=True,
                )
                t0 = time.monotonic()
                while time.monotonic() - t0 < limit:
                    time.sleep(min(1.0, renew / 4))
                    now = self.read()
                    if now != held:
                        raise RuntimeError(
                            f"AutoCheckpoint: {self._holder(now or held)} is mirroring this run to {self.url} (it "
                            f"renewed the lock {self.lock_name} just now); two machines writing one run's checkpoints "
                            "would delete each other's files. Stop the other one, or give this one another remote."
                        )
                print(f"AutoCheckpoint: {self._holder(held)} has not renewed its lock for {limit:.0f} s: taken over")
        self.write()
        time.sleep(1.0)  # two machines taking a free lease at once: the one written last wins, the other sees it
        now = self.read()
        if now is None or now.get("token") != self.token:
            raise RuntimeError(
                f"AutoCheckpoint: {self._holder(now or {})} took the lock {self.lock_name} of {self.url} at the same "
                "time as this process; two machines writing one run's checkpoints would delete each other's files."
            )

    def fence(self):
        "Raises `Lost` (and this mirror stops) if another process holds the lease now."
        held = self.read()
        if held is None:  # removed (by hand): nobody else holds it
            return self.write()
        if held.get("token") != self.token:
            with self.lost_lock:
                if self.lost is None:
                    self.lost = (
                        f"AutoCheckpoint: the lock {self.lock_name} of {self.url} is held by {self._holder(held)} now "
                        "(this process did not renew it in time: the remote was unreachable): this process no longer "
                        "mirrors the run (its local checkpoints go on), so as not to delete the other one's files"
                    )
                    self.notices.post(self.lost)
            self.ended.set()
            raise Lost(self.lost)

    def _renew_loop(self):
        while not self.ended.wait(RENEW):
            try:
                self.fence()
                self.write()
            except Lost:
                return
            except Exception:
                pass  # unreachable: the upload thread says so; the lease lapses if it stays so

    def stop(self) -> None:
        "The process's end: no more renewals (one under way ends first, so that `release` is the last write)."
        self.ended.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=RENEW)

    def release(self) -> None:
        "Removes the lock if this process still holds it."
        if self.lost is None:
            with contextlib.suppress(Exception):
                held = self.read()
                if held is not None and held.get("token") == self.token:
                    self.fs.rm_file(self.path)
