"""The supported matrix (docs/install.md) is what `make matrix` ran (.ci/matrix.json, written by .ci/matrix.py):
every Python pyproject.toml claims, with the newest stack CI pins and the oldest the package claims,
all passed; the table matches the file, and a cell edited by hand is caught. Pure JSON -> Markdown."""

import json
import os
import re
import sys

import pytest
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, ".ci"))
import matrix  # noqa: E402


@pytest.fixture(scope="module")
def res():
    with open(matrix.RESULTS) as f:
        return json.load(f)


def readme():
    with open(os.path.join(ROOT, "docs", "install.md")) as f:
        return f.read()


def test_the_readmes_table_is_the_matrix_files(res):
    assert matrix.problems(readme(), res) == []


def test_every_claimed_python_ran_with_the_newest_and_the_oldest_stack_and_passed(res):
    ran = [(r["python"].rsplit(".", 1)[0], r["stack"]) for r in res["rows"]]
    assert ran == [(py, stack) for py in matrix.pythons() for stack in matrix.STACKS]
    assert matrix.pythons() == ["3.11", "3.12", "3.13"]
    for r in res["rows"]:
        assert r["failed"] == 0 and r["pytest_rc"] == 0 and r["passed"] > 0, r["name"]
        assert r["installed"]["core"].startswith("fastai_resume/_core.cpython-"), r["name"]  # the wheel's own


def test_every_row_installed_its_pythons_manylinux_wheel_tagged_what_auditwheel_allows(res):
    """`make wheels` tagged each wheel what `auditwheel show` allowed it, no narrower than torch's
    manylinux_2_28, and each row had pip install its own Python's (with no compiler on PATH: below)."""
    assert list(res["wheels"]) == matrix.pythons()
    for py, w in res["wheels"].items():
        tag = f"cp{py.replace('.', '')}"
        assert w["wheel"] == f"fastai_resume-{res['rows'][0]['installed']['version']}-{tag}-{tag}-{w['tag']}.whl"
        m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", w["tag"])
        assert m and int(m.group(1)) <= 28 and w["glibc"] == f"2.{m.group(1)}", w
        assert 0 < w["bytes"] < 1 << 20, w  # the package and its core: no grafted library, no build tree
    for r in res["rows"]:
        assert r["wheel"] == res["wheels"][r["python"].rsplit(".", 1)[0]]["wheel"], r["name"]
        assert 0 < r["seconds"]["install"] < r["seconds"]["setup"], r["name"]


def test_a_rows_install_refuses_a_path_with_a_compiler(tmp_path):
    (tmp_path / "bin").mkdir()
    for name in ("cc", "python"):  # a compiler, and a venv's python that fails whatever it is asked
        (tmp_path / "bin" / name).write_text("#!/bin/sh\nexit 3\n")
        (tmp_path / "bin" / name).chmod(0o755)
    with pytest.raises(SystemExit, match=r"a compiler on the install's PATH: \['cc'\]"):
        matrix.install_without_compiler("row", str(tmp_path), "fastai_resume-0-cp311-cp311-x.whl", "c.txt", "r.json")
    (tmp_path / "bin" / "cc").unlink()  # the control: without it the check passes, and pip is what fails
    with pytest.raises(SystemExit, match=r"pip install .* failed \(3\)"):
        matrix.install_without_compiler("row", str(tmp_path), "fastai_resume-0-cp311-cp311-x.whl", "c.txt", "r.json")


def test_the_newest_rows_ran_what_constraints_dev_pins(res):
    pinned = dict(p.split("==") for p in matrix.pins("newest"))
    for r in res["rows"]:
        if r["stack"] == "newest":
            assert {n: r[n] for n in ("torch", "torchvision", "fastai")} == pinned, r["name"]


def test_the_oldest_rows_ran_every_lower_bound_pyproject_claims(res):
    low = matrix.lower_bounds()
    assert set(low) == {"fastai", "fastcore", "torch"}
    for r in res["rows"]:
        if r["stack"] == "oldest":
            assert {n: Version(r[n]) for n in low} == {n: Version(v) for n, v in low.items()}, r["name"]
            assert r["torchvision"] == matrix.TORCHVISION[low["torch"]]


def test_requires_python_is_the_oldest_python_the_matrix_runs():
    assert matrix.pyproject()["requires-python"] == f">={matrix.pythons()[0]}"


def test_ci_runs_the_matrix():
    with open(os.path.join(ROOT, "Makefile")) as f:
        target = f.read().split("\nmatrix:", 1)[1].split("\n\n", 1)[0]
    assert ".ci/matrix.py" in target
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert re.search(r"^make matrix$", f.read(), re.M)


def test_the_tests_the_matrix_runs_exist():
    for t in matrix.TESTS:
        path, _, name = t.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert not name or f"def {name.split('[')[0]}(" in f.read(), t


def test_a_cell_changed_by_hand_in_the_readme_is_reported(res):
    text = readme()
    m = re.search(r"<!-- matrix -->\n.*?\| (2\.8\.9) \|", text, re.S)
    edited = text[: m.start(1)] + "2.8.8" + text[m.end(1) :]
    assert matrix.problems(edited, res) == [
        "docs/install.md's matrix differs from .ci/matrix.json (run python3 .ci/matrix.py --rewrite)"
    ]


def test_rewriting_puts_the_table_between_the_markers(res):
    empty = re.sub(r"(<!-- matrix -->\n).*?(<!-- /matrix -->)", r"\1\2", readme(), flags=re.S)
    assert matrix.problems(empty, res) != []
    assert matrix.rewrite(empty, res) == readme()
