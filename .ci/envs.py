#!/usr/bin/env python3
"""The machine's Python environments, installed once and copied as hard links: the dev venv that
`make` uses (`.venv`: requirements-dev.txt under constraints-dev.txt) and the clean venvs of
`make matrix`'s rows (.ci/matrix.py).

Installing torch and the rest takes minutes and ~6 GB; each environment is installed once per
machine under ~/.cache/fastai-resume/matrix/ (named by a hash of the Python, the requirements and
the pins; never changed once complete; one unused for 14 days is removed), and each venv made from
it is a hard-linked copy: a fresh clone's `make` has its venv in seconds, with no disk of its own.

    python3 .ci/envs.py dev .venv     # (re)make the dev venv at .venv (the Makefile does this)
"""

import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("FRK_MATRIX_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastai-resume", "matrix"
)
UNUSED_DAYS = 14


def sh(cmd, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
    return p.stdout.strip()


def lines(name):
    "A requirements file's entries, without comments."
    with open(os.path.join(ROOT, name)) as f:
        return [s for s in (line.split("#")[0].strip() for line in f) if s]


def prune_cache():
    "Environments no run has used for UNUSED_DAYS days (and none being built) are removed."
    for ready in glob.glob(os.path.join(CACHE, "*", ".ready")):
        env = os.path.dirname(ready)
        if time.time() - os.path.getmtime(ready) > UNUSED_DAYS * 86400:
            with open(env + ".lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                shutil.rmtree(env, ignore_errors=True)


def environment(name, exe, reqs, constraints, tools=(), first=()):
    """The machine's environment `name`: `reqs` and `tools` under `constraints`, installed once
    (under a lock, complete only with its `.ready`) after upgrading `first` (pip's own tools).
    Returns its path and whether this call installed it."""
    spec = {
        "python": sh([exe, "-c", "import sys; print(sys.version)"]),
        "requires": list(reqs),
        "tools": list(tools),
        "constraints": list(constraints),
    }
    if first:
        spec["first"] = list(first)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    env = os.path.join(CACHE, f"{name}-{key}")
    os.makedirs(CACHE, exist_ok=True)
    with open(env + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = os.path.join(env, ".ready")
        if os.path.exists(ready):
            os.utime(ready)
            return env, False
        shutil.rmtree(env, ignore_errors=True)
        sh([exe, "-m", "venv", env])
        cfile = os.path.join(env, "constraints.txt")
        with open(cfile, "w") as f:
            f.write("\n".join(constraints) + "\n")
        pip = [os.path.join(env, "bin", "python"), "-m", "pip", "install", "-q"]
        if first:
            sh([*pip, "--upgrade", *first])
        sh([*pip, *reqs, *tools, "-c", cfile])
        with open(os.path.join(env, "spec.json"), "w") as f:
            json.dump(spec, f, indent=1)
        if shutil.which("hardlink"):  # the same torch's libraries under another Python: one copy on disk
            subprocess.run(["hardlink", "-q", "-t", "-f", "-s", "1M", CACHE])
        open(ready, "w").close()
    return env, True


def clean_venv(env, venv):
    """A hard-linked copy of `env` at `venv`: a venv of its own (Python finds its prefix by where
    it runs from); the scripts in bin/ that name `env` are rewritten as new files, never in place
    (their inodes are `env`'s)."""
    if os.path.islink(venv):
        os.unlink(venv)
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(venv)), exist_ok=True)
    if subprocess.run(["cp", "-al", env, venv], capture_output=True).returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        sh(["cp", "-a", env, venv])  # another file system: a plain copy
    bindir = os.path.join(venv, "bin")
    for name in os.listdir(bindir):
        path = os.path.join(bindir, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if env.encode() in data:
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data.replace(env.encode(), venv.encode()))
            shutil.copymode(path, tmp)
            os.replace(tmp, path)


def dev(venv):
    "The dev venv at `venv`: requirements-dev.txt under constraints-dev.txt, on the Python running this."
    env, built = environment(
        "dev",
        sys.executable,
        lines("requirements-dev.txt"),
        lines("constraints-dev.txt"),
        first=["pip", "setuptools", "wheel"],
    )
    clean_venv(env, os.path.abspath(venv))
    print(f"{venv}: {'installed into' if built else 'copied from'} {env}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "dev":
        sys.exit("usage: python3 .ci/envs.py dev VENV")
    prune_cache()
    dev(sys.argv[2])
