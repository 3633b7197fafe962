"""Interpreters with torch and fastai already imported, which fork the suite's trainer processes.

Most tests run `tests/trainer.py` or `tests/workloads.py` as new processes (a reference, a run that
dies by SIGKILL, the rerun) and a new interpreter spends ~4 s of CPU importing torch, fastai and
scikit-learn before its first batch. A server here imports them once; for each run it forks, and the
child becomes what `python SCRIPT ARGS` would have been: the script runs as `__main__` with its
`sys.argv` and `sys.path[0]`, in the caller's folder and environment, its output in pipes the caller
reads to their end (as `subprocess.run` does: processes the run left behind, such as DataLoader
workers of a killed run, hold them until they exit); it ends the way an interpreter ends (atexit,
non-daemon threads joined, exit status, a death by signal seen as one). The package itself is never imported by a server: each run imports it, and
patches fastai, as a user's script does.

What a fork cannot give a run, it is given another way or the run gets a new interpreter:
- the hash seed: fixed when an interpreter starts, so each caller keeps two servers (two random
  seeds) and alternates them: a killed run and the rerun right after it never iterate sets of
  strings in one order (tests that run something between them order their runs for that);
- the RNGs seeded at import (`random`, numpy's global one): reseeded from the OS in the child;
- the environment: variables read at import time (OMP_NUM_THREADS, PYTHONWARNINGS) must be the
  run's when torch is imported, so each environment has its own servers, started with it;
- threads: a server forks only while it has one thread (it checks `/proc/self/task`).

FRK_TEST_FRESH=1 makes every run a new interpreter (the suite before this file, for comparison).
"""

import atexit
import os
import pickle
import socket
import struct
import subprocess
import sys

# What tests/trainer.py and tests/workloads.py import before the package (their lazy imports, such
# as fastai.text and fastai.vision, still happen after it, in the run, as in a user's script).
PRELOAD = """
import numpy, torch, torch.nn
import fastai.callback.schedule, fastai.callback.core, fastai.callback.tracker, fastai.callback.training
import fastai.callback.progress, fastai.data.core, fastai.data.load, fastai.learner, fastai.losses
import fastai.metrics, fastai.optimizer, fastai.torch_core, fasttransform, sklearn.datasets
"""


def _send(sock, obj, fds=()):
    data = pickle.dumps(obj)
    socket.send_fds(sock, [struct.pack("<Q", len(data)) + data], list(fds))


def _recv_exactly(sock, n, have=b""):
    while len(have) < n:
        more = sock.recv(n - len(have))
        if not more:
            raise EOFError("fork server: the connection closed mid-message")
        have += more
    return have


def _recv(sock, maxfds=0):
    "One message (None at end of stream) and the descriptors sent with it."
    head, fds, _, _ = socket.recv_fds(sock, 8, maxfds)
    if not head:
        return None, fds
    (n,) = struct.unpack("<Q", _recv_exactly(sock, 8, head))
    return pickle.loads(_recv_exactly(sock, n)), fds


def _serve(sock):
    "Answers requests until the caller closes the connection; returns only in a forked child."
    while True:
        req, fds = _recv(sock, maxfds=2)
        if req is None:
            sys.exit(0)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1 or "fastai_resume" in sys.modules:
            for fd in fds:
                os.close(fd)
            _send(
                sock, {"error": f"cannot fork: {threads} threads, package imported: {'fastai_resume' in sys.modules}"}
            )
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            return req, fds
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"returncode": os.waitstatus_to_exitcode(status)})


def _become(req, fds):
    "In the child: take the request's output, folder, environment and arguments, then run its script."
    import random
    import runpy

    import numpy

    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    random.seed()
    numpy.random.seed()
    script = req["argv"][1]
    sys.argv = req["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


class Server:
    "One server process, started with `env`, and the caller's end of its connection."

    def __init__(self, env):
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            # pandas imports pyarrow where it is installed (`datasets` needs it), and pyarrow's jemalloc
            # starts a purging thread at import: a server with two threads cannot fork
            env=dict(env, JE_ARROW_MALLOC_CONF="background_thread:false"),
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = mine

    def run(self, argv, cwd, env, timeout):
        """Like `subprocess.run(argv, capture_output=True, text=True)`, in a child of this server. A run
        left unfinished (its test timed out, an error here) closes the connection: the server ends
        once its child does, and its answers can never reach the next run."""
        try:
            return self._run(argv, cwd, env, timeout)
        except BaseException:
            self.sock.close()
            raise

    def _run(self, argv, cwd, env, timeout):
        import threading

        pipes = [os.pipe(), os.pipe()]  # stdout, stderr: read here until every holder closes them
        try:
            _send(self.sock, {"argv": argv, "cwd": cwd, "env": env}, [w for _, w in pipes])
        finally:
            for _, w in pipes:
                os.close(w)
        chunks = [[], []]

        def drain(i):
            with open(pipes[i][0], "rb", closefd=True) as f:
                chunks[i].extend(iter(lambda: f.read(65536), b""))

        readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(2)]
        for t in readers:
            t.start()
        msg, _ = _recv(self.sock)
        if msg is None or "error" in msg:
            raise RuntimeError(f"fork server: {msg}")
        pid = msg["pid"]
        self.sock.settimeout(timeout)
        try:
            msg, _ = _recv(self.sock)
        except TimeoutError:
            os.kill(pid, 9)
            self.sock.settimeout(None)
            _recv(self.sock)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        finally:
            self.sock.settimeout(None)
        if msg is None:
            raise RuntimeError("fork server: the server died")
        for t in readers:  # as subprocess.run: until the output's end (a process the run left may hold it)
            t.join()
        out, err = (b"".join(c).decode(errors="replace").replace("\r\n", "\n") for c in chunks)
        return subprocess.CompletedProcess(argv, msg["returncode"], out, err)


class Pool:
    "For each environment, two servers with different hash seeds, used in turn; started at their first run."

    def __init__(self):
        self.servers, self.turns = {}, {}
        atexit.register(self.close)

    def close(self):
        "Ends every server (each exits when its connection closes) and waits for it."
        for pair in self.servers.values():
            for s in pair:
                s.sock.close()
                s.proc.wait()
        self.servers.clear()

    def run(self, argv, env, timeout=None, cwd=None):
        "Runs `python SCRIPT ARGS` (`argv`) like `subprocess.run(argv, capture_output=True, text=True)`."
        if os.environ.get("FRK_TEST_FRESH") == "1" or argv[0] != sys.executable or argv[1].startswith("-"):
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
        key = tuple(sorted(env.items()))
        if key not in self.servers or any(s.sock.fileno() < 0 for s in self.servers[key]):
            for s in self.servers.get(key, ()):
                s.sock.close()
            self.servers[key], self.turns[key] = [Server(env) for _ in range(2)], 0
        self.turns[key] ^= 1
        return self.servers[key][self.turns[key]].run(argv, os.path.abspath(cwd or os.getcwd()), env, timeout)


if __name__ == "__main__":
    conn = socket.socket(fileno=int(sys.argv[1]))
    exec(PRELOAD)
    import gc

    gc.freeze()  # the imported objects are never collected: children neither scan nor copy them
    try:
        job = _serve(conn)
    except (ConnectionError, EOFError):  # the caller went away mid-run: nobody to answer
        sys.exit(0)
    del conn
    _become(*job)
