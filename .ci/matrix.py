#!/usr/bin/env python3
"""The supported matrix, tested as users install the package (`make matrix`; CI runs it last).

The wheels are `make wheels`' (.ci/wheels.py: manylinux, one per Python, built with zig cc from the
sdist; built here unless build/wheels/ holds those of these sources). Each row, a Python with the
newest or the oldest stack the package claims, has pip install the package into a clean venv from
the wheels' folder with no compiler on PATH and binaries only (it must take that Python's wheel),
and runs, from a copy of the checkout without the package (so the tests import the installed one),
the subset that proves the package works there: `TESTS`, less the tests marked `slow`. The C
core's own tests are `make ctest`'s (the core is plain C: they do not depend on the Python).

    newest: constraints-dev.txt's pins (torch, torchvision, fastai: what CI's dev venv runs)
    oldest: the lower bound of every dependency in pyproject.toml that has one, and the
            torchvision built for that torch (`TORCHVISION`)

The Pythons are pyproject.toml's classifiers, found under pyenv (or on PATH as pythonX.Y).

Downloads and installs happen once per machine (pip's cache, shared by every venv, stays empty
behind a package proxy that sends no caching headers, as this machine's does): a row's dependencies
are installed once into an environment of .ci/envs.py's cache, from which each run makes the row's
clean venv as a hard-linked copy (under a second, no disk) before pip installs the wheel into it.
Identical libraries of those environments (the CUDA libraries of the same torch under two Pythons)
are hard-linked too.

    python3 .ci/matrix.py                       # all rows; writes .ci/matrix.json
    python3 .ci/matrix.py --rows 3.12:newest    # some rows; writes build/matrix/matrix.json
    python3 .ci/matrix.py --rewrite             # the README's table from .ci/matrix.json
    python3 .ci/matrix.py --check               # exit 1 if the README's table differs from it
"""

import argparse
import email.parser
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
import zipfile

import wheels
from envs import CACHE, clean_venv, environment, lines, prune_cache, sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "matrix")
RESULTS = os.path.join(ROOT, ".ci", "matrix.json")
README = os.path.join(ROOT, "docs", "install.md")  # the page the table lives in
STACKS = ("newest", "oldest")
TORCHVISION = {"2.6": "0.21.0"}  # torchvision pins torch exactly: the one built for the oldest torch
TOOLS = ["pytest", "pytest-timeout", "pytest-xdist", "filelock"]
TESTS = [
    "tests/test_format.py",
    "tests/test_exact.py::test_kill_at_iteration_k_then_resume_is_bitwise_equal[middle-batch-middle-epoch]",
    "tests/test_cli.py",
    "tests/test_compat.py",
]
SELECT = "not slow"
PYTEST = ["-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal", "--timeout", "1200", "-m", SELECT]
BLOCK = re.compile(r"(<!-- matrix -->\n)(?P<body>.*?)(<!-- /matrix -->)", re.S)


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def pythons():
    "The Python versions pyproject.toml's classifiers claim, in order."
    prefix = "Programming Language :: Python :: "
    return [c[len(prefix) :] for c in pyproject()["classifiers"] if c.startswith(prefix) and c.count(".") == 1]


def lower_bounds():
    "{name: version} for each dependency of pyproject.toml with a lower bound (`>=`)."
    out = {}
    for dep in pyproject()["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", dep)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def pins(stack):
    "The constraints file's lines for `stack`."
    if stack == "newest":
        return lines("constraints-dev.txt")
    low = lower_bounds()
    return [f"{n}=={v}" for n, v in low.items()] + [f"torchvision=={TORCHVISION[low['torch']]}"]


def find_python(version):
    "The interpreter of `version` (3.12): pyenv's newest patch release of it, else pythonX.Y on PATH."
    found = []
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))
    except OSError:
        pass
    found.sort(key=lambda p: [int(x) for x in re.findall(r"\d+", p.split("/versions/")[1].split("/")[0])])
    for exe in found[::-1] + [shutil.which(f"python{version}")]:
        if exe and sh([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=False) == version:
            return exe
    sys.exit(f"matrix: no Python {version} found (pyenv install {version}, or put python{version} on PATH)")


def log(msg):
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def requirements(whl):
    "The wheel's own requirements (its extras left out), as pip reads them."
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return sorted(r for r in msg.get_all("Requires-Dist", []) if "extra ==" not in r)


def checkout_copy():
    "A copy of the tracked files but the package and its C sources: tests read their checkout from it."
    tree = os.path.join(BUILD, "tree")
    shutil.rmtree(tree, ignore_errors=True)
    for rel in sh(["git", "ls-files"], cwd=ROOT).splitlines():
        if rel.split("/")[0] in ("fastai_resume", "csrc"):
            continue
        os.makedirs(os.path.join(tree, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(tree, rel))
    return tree


PROBE = """\
import json, os, platform, sysconfig, importlib.metadata as md
import fastai_resume, fastai_resume._core as core
from fastai_resume import snapshot
site = sysconfig.get_paths()["platlib"]
v = {n: md.version(n) for n in ("fastai-resume", "fastai", "fastcore", "torch", "torchvision", "numpy")}
print(json.dumps(dict(v, python=platform.python_version(), version=fastai_resume.__version__,
    package=os.path.relpath(fastai_resume.__file__, site), core=os.path.relpath(core.__file__, site),
    copy_on_openmp=bool(snapshot.COPY_ON_OPENMP))))
"""


COMPILERS = ("cc", "gcc", "clang", "c99", "tcc", "zig")


def install_without_compiler(name, venv, wheel, constraints, report):
    """pip installs the package by name, as from an index, from the folder of the wheels (every
    Python's, and the sdist): with no compiler on PATH (the venv's bin/ only), no CC, binaries
    only. It must take this Python's manylinux wheel and install nothing else. Returns the seconds
    pip took."""
    path = os.path.join(venv, "bin")
    found = [c for c in COMPILERS if shutil.which(c, path=path)]
    if found:
        sys.exit(f"matrix: {name}: a compiler on the install's PATH: {found}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CC", "CXX", "LDSHARED")}
    env["PATH"] = path
    version = os.path.basename(wheel).split("-")[1]
    cmd = [os.path.join(path, "python"), "-m", "pip", "install", "-q", "--no-index", "--only-binary", ":all:"]
    t0 = time.monotonic()
    links = ["--find-links", os.path.dirname(wheel)]
    sh([*cmd, *links, f"fastai-resume=={version}", "-c", constraints, "--report", report], env=env)
    seconds = time.monotonic() - t0
    with open(report) as f:
        installed = json.load(f)["install"]
    names = sorted(i["metadata"]["name"] for i in installed)
    if names != ["fastai-resume"]:  # the environment is the wheel's requirements: nothing else to add
        sys.exit(f"matrix: {name}: installing the wheel also installed {names}")
    url = installed[0]["download_info"]["url"]
    if os.path.basename(url) != os.path.basename(wheel):
        sys.exit(f"matrix: {name}: pip took {url}, not {os.path.basename(wheel)}")
    return seconds


def run_row(py, stack, wheel, tree):
    name = f"py{py}-{stack}"
    out = os.path.join(BUILD, name)
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    constraints = pins(stack)
    env, built = environment(name, find_python(py), requirements(wheel), constraints, TOOLS)
    venv = os.path.join(out, "venv")
    clean_venv(env, venv)
    vpy = os.path.join(venv, "bin", "python")
    report = os.path.join(out, "install.json")
    t_install = install_without_compiler(name, venv, wheel, os.path.join(env, "constraints.txt"), report)
    sh([vpy, "-m", "pip", "check"])
    t1 = time.monotonic()
    env_vars = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env_vars.update(FRK_MATRIX_WHEEL=wheel, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"])
    probe = json.loads(sh([vpy, "-c", PROBE], cwd=tree, env=env_vars))
    junit = os.path.join(out, "junit.xml")
    shutil.rmtree(os.path.join(out, "tmp"), ignore_errors=True)
    cmd = [vpy, "-m", "pytest", *PYTEST, "--basetemp", os.path.join(out, "tmp"), "--junitxml", junit, *TESTS]
    with open(os.path.join(out, "pytest.log"), "w") as logf:
        rc = subprocess.run(cmd, cwd=tree, env=env_vars, stdout=logf, stderr=subprocess.STDOUT).returncode
    with open(os.path.join(out, "pytest.log")) as f:
        lines = f.read().splitlines()
    print("\n".join(lines[-(40 if rc else 1) :]), flush=True)
    s = ET.parse(junit).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    row = {
        "name": name,
        "python": probe["python"],
        "stack": stack,
        **{k: probe[k] for k in ("fastai", "fastcore", "torch", "torchvision", "numpy", "copy_on_openmp")},
        "wheel": os.path.basename(wheel),
        "installed": {"version": probe["fastai-resume"], "package": probe["package"], "core": probe["core"]},
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "pytest_rc": rc,
        "environment": {"name": os.path.basename(env), "installed_now": built},
        "seconds": {
            "setup": round(t1 - t0, 1),  # the venv, then pip installing the wheel into it (`install`)
            "install": round(t_install, 1),
            "tests": round(time.monotonic() - t1, 1),
        },
    }
    assert probe["version"] == probe["fastai-resume"], probe  # the wheel's metadata is the package's own
    log(f"{name}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped {row['seconds']}")
    return row


def render(res) -> str:
    "The README's table: what each row ran, nothing timed."
    out = [
        "| Python | fastai | fastcore | torch | torchvision | numpy | stack | snapshot copy | tests |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        copy = "torch's OpenMP pool" if r["copy_on_openmp"] else "a thread of its own"
        tests = f"{r['passed']} passed" + (f", {r['failed']} failed" if r["failed"] else "")
        out.append(
            f"| {r['python']} | {r['fastai']} | {r['fastcore']} | {r['torch']} | {r['torchvision']} | {r['numpy']} "
            f"| {r['stack']} | {copy} | {tests} |"
        )
    wheel = re.sub(r"-cp\d+-cp\d+-", "-cpXY-cpXY-", res["rows"][0]["wheel"])
    kib = sorted({round(w["bytes"] / 1024) for w in res["wheels"].values()})
    size = f"{kib[0]}" if len(kib) == 1 else f"{kib[0]} to {kib[-1]}"
    out += [
        "",
        f"Each row: the wheel of its Python (`{wheel}`, {size} KiB, "
        "`make wheels`) installed by pip into a clean venv "
        "with no compiler on PATH (`--no-index --only-binary :all:`), then "
        + ", ".join(f"`{t}`" for t in res["tests"])
        + f" (`-m '{res['select']}'`), run from a copy of the checkout without the package"
        + f" ({res['platform']}, `{res['command']}`, `.ci/matrix.json`).",
    ]
    return "\n".join(out) + "\n"


def problems(text, res) -> list:
    m = BLOCK.search(text)
    if m is None:
        return ["docs/install.md has no <!-- matrix --> block"]
    if m.group("body") != render(res):
        return ["docs/install.md's matrix differs from .ci/matrix.json (run python3 .ci/matrix.py --rewrite)"]
    return []


def rewrite(text, res) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(res) + m.group(3), text, count=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", metavar="PY:STACK", help="e.g. 3.12:newest (default: every row)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's table differs from .ci/matrix.json")
    ap.add_argument("--rewrite", action="store_true", help="write the README's table from .ci/matrix.json")
    a = ap.parse_args()
    if a.check or a.rewrite:
        with open(RESULTS) as f:
            res = json.load(f)
        with open(README) as f:
            text = f.read()
        if a.rewrite:
            with open(README, "w") as f:
                f.write(rewrite(text, res))
            text = rewrite(text, res)
        bad = problems(text, res)
        print("\n".join(bad) or "README.md's matrix is .ci/matrix.json's", file=sys.stderr if bad else sys.stdout)
        sys.exit(1 if bad else 0)

    t0, load0 = time.monotonic(), round(os.getloadavg()[0], 1)
    every = [(py, st) for py in pythons() for st in STACKS]
    rows = [tuple(r.split(":")) for r in a.rows] if a.rows else every
    prune_cache()
    built = wheels.ensure()
    tree = checkout_copy()
    t_build = time.monotonic() - t0
    log(f"{built['sdist']} and {len(built['wheels'])} wheels in {t_build:.0f} s; environments in {CACHE}")
    out = [run_row(py, st, built["paths"][py], tree) for py, st in rows]
    res = {
        "command": "make matrix",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "platform": f"{platform.system().lower()} {platform.machine()}",
        "cores": os.cpu_count(),
        "loadavg": {"start": load0, "end": round(os.getloadavg()[0], 1)},  # a machine shared with other work
        "sdist": built["sdist"],
        "wheels": built["wheels"],  # per Python: its tag, the tag auditwheel allows, its glibc, its size
        "tests": TESTS,
        "select": SELECT,
        "rows": out,
        "seconds": {"build": round(t_build, 1), "total": round(time.monotonic() - t0, 1)},
    }
    path = RESULTS if rows == every else os.path.join(BUILD, "matrix.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    failed = [r["name"] for r in out if r["failed"] or r["pytest_rc"] or not r["passed"]]
    log(f"{len(out)} rows in {res['seconds']['total']:.0f} s, written to {os.path.relpath(path, ROOT)}")
    if path == RESULTS:
        with open(README) as f:
            for p in problems(f.read(), res):
                log(f"note: {p}")  # a newer numpy or fastcore resolved: not a failure
    if failed:
        sys.exit(f"matrix: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
