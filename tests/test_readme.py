"""The README and the pages of docs/ are a contract: their Python blocks run as written, every test
they cite exists, and every page they link to is there.

Each Python block runs as a new process in a fresh temporary working directory (so fastai's default
relative paths are the user's), after a prelude that supplies only what the text leaves to the
user's own script: their data (`dls`), their `model`, and fastai's `Learner` and `accuracy`. A
block whose first line says it is launched by `torchrun` is launched that way, with 2 processes on
the CPU. What a block promises beyond running is checked by its section's entry in `PROMISES`; a
block whose first line says `# tested as tests/...` is that test's script (it needs data the prelude
does not have) and is checked there.

A sentence cites the test that proves it as `` `tests/test_x.py::test_name` `` (or a whole file as
`` `tests/test_x.py` ``); a citation of a test that does not exist fails here. docs/claims.md lists
the README's claims with their tests.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastai_resume as fr

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}}
ENV = dict(
    os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1"
)  # CPU: the README's `cpu=True`

PRELUDE = """\
# The user's own script up to the README's block: fastai's names, their data and their model
# (420 of scikit-learn's digits), with fastai's default paths (relative to the working directory).
import torch
from torch import nn
from sklearn.datasets import load_digits
from fastai.data.block import CategoryBlock, DataBlock, TransformBlock
from fastai.data.transforms import IndexSplitter, ItemGetter
from fastai.learner import Learner
from fastai.metrics import accuracy
X, y = load_digits(return_X_y=True)
items = list(zip(torch.tensor(X / 16.0, dtype=torch.float32), y.tolist()))[:420]
dls = DataBlock(blocks=(TransformBlock, CategoryBlock), get_x=ItemGetter(0), get_y=ItemGetter(1),
                splitter=IndexSplitter(range(320, 420))).dataloaders(items, bs=32, device="cpu")
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
# ---- the README's block, as written ----
"""


def code_blocks(text):
    "(section heading, language, code) of every fenced block, in order."
    out, heading = [], ""
    for m in re.finditer(r"^(#+) ([^\n]*)$|^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if m.group(1):
            heading = m.group(2).strip()
        else:
            out.append((heading, m.group(3), m.group(4)))
    return out


def _defined(tree, parts):
    "True if `parts` (a function, a class, or Class::method) is defined at the top of `tree`."
    body = tree.body
    for part in parts:
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            return False
        body = getattr(node, "body", [])
    return True


def missing_tests(text, root=ROOT):
    "Each citation `tests/FILE.py[::NAME]` in `text` whose file or test does not exist."
    for m in re.finditer(r"`(tests/[\w/.-]+\.py)(?:::([\w:]+)(?:\[[^\]`]*\])?)?`", text):
        path, name = root / m.group(1), m.group(2)
        if not path.is_file() or (name and not _defined(ast.parse(path.read_text()), name.split("::"))):
            yield m.group(0).strip("`")


def _models(cwd, ends=False):
    """The checkpoint files in models/ (not AutoCheckpoint's hidden lock file); `ends`: the stages' end
    states (`fastai_resume.between`) instead of the checkpoints."""
    return sorted(
        p.name for p in (cwd / "models").iterdir() if not p.name.startswith(".") and p.name.endswith("-end.frk") == ends
    )


def quick_start(cwd, out):
    "AutoCheckpoint keeps the newest 3 of the run and each stage's end state; every file verifies."
    names, ends = _models(cwd), _models(cwd, ends=True)
    assert len([n for n in names if n.startswith("auto-")]) == 3, names
    assert ends and all(n.startswith("auto-") for n in ends), ends  # each stage's end state, for a rerun
    for n in names:
        fr.info(cwd / "models" / n, verify=True)


def data_parallel(cwd, out):
    "Rank 0 alone writes each checkpoint; the default keep=3 holds."
    names = _models(cwd)
    assert len(names) == 3 and all(n.startswith("auto-") and n.endswith(".frk") for n in names), names
    for n in names:
        fr.info(cwd / "models" / n, verify=True)


def several_stages(cwd, out):
    "Three stages, AutoCheckpoint's newest 3 of the run, each stage's end, the CSV history of every stage."
    names = [n for n in _models(cwd) if n.startswith("auto-")]
    assert len(names) == 3 and any("-s002-" in n for n in names), names
    assert [n[-12:] for n in _models(cwd, ends=True)] == ["s000-end.frk", "s001-end.frk", "s002-end.frk"]
    assert (cwd / "history.csv").read_text().count("epoch,") >= 3


def sharded_training(cwd, out):
    "Each checkpoint a folder: a manifest and one file per rank, verified as a whole; the default keep=3 holds."
    names = [n for n in _models(cwd) if n.startswith("auto-")]
    assert len(names) == 3 and all((cwd / "models" / n / "manifest.frk").is_file() for n in names), names
    for n in names:
        assert len(list((cwd / "models" / n).iterdir())) == 3  # the manifest and 2 ranks' files
        fr.shardfiles.verify(cwd / "models" / n)


PROMISES = {
    "Training": sharded_training,
    "Quick start": quick_start,
    "A script of several stages": several_stages,
    "Data-parallel training (DDP through `distrib_ctx`)": data_parallel,
}
KNOWN_FAILURES: dict = {}  # section: why its block fails today (strict: the marker goes when the README is fixed)
PYTHON_BLOCKS = [
    (h, code)
    for text in PAGES.values()
    for h, lang, code in code_blocks(text)
    if lang == "python" and not code.startswith("# tested as tests/")
]


def launched_by_torchrun(code: str) -> bool:
    "A block whose first line says torchrun runs as a 2-process job, as its README text launches it."
    return "torchrun" in code.splitlines()[0]


@pytest.mark.parametrize(
    "heading,code",
    [
        pytest.param(
            h,
            code,
            id=re.sub(r"\W+", "-", h.lower()).strip("-"),
            marks=([pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[h])] if h in KNOWN_FAILURES else [])
            + ([pytest.mark.slow] if launched_by_torchrun(code) else []),
        )
        for h, code in PYTHON_BLOCKS
    ],
)
def test_the_readme_python_block_runs_as_written(heading, code, tmp_path):
    assert heading in PROMISES, f"say in PROMISES what the block of '{heading}' promises, and check it"
    (tmp_path / "train.py").write_text(PRELUDE + code)
    launch = [sys.executable, "train.py"]
    if launched_by_torchrun(code):
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    p = subprocess.run(launch, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    PROMISES[heading](tmp_path, p.stdout)


def test_the_readme_has_the_python_blocks_this_file_knows():
    "A block added, renamed or removed in the README or docs/ is noticed here."
    assert sorted(h for h, _ in PYTHON_BLOCKS) == sorted(PROMISES)


@pytest.mark.parametrize("page", list(PAGES))
def test_every_test_the_readme_and_the_docs_cite_exists(page):
    assert list(missing_tests(PAGES[page])) == []


def test_the_claims_table_cites_a_test_for_each_claim_and_the_readme_links_to_pages_that_exist():
    claims = PAGES["docs/claims.md"]
    rows = [line for line in claims.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert len(rows) >= 10 and all(re.search(r"`tests/[^`]+`", row) for row in rows), "a claim without its test"
    for page, text in PAGES.items():
        for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text):
            target = (ROOT / link) if page == "README.md" else (ROOT / "docs" / link)
            assert target.is_file(), f"{page} links to {link}, which is not there"
    assert len(README.splitlines()) < 200, "the README is a guide: details go to docs/"


def test_a_citation_of_a_missing_test_is_found(tmp_path):
    text = (
        "Proven by `tests/test_cli.py::test_verify_of_a_good_checkpoint_is_one_ok_line`, "
        "`tests/test_cli.py::test_inspect_of_a_file_that_is_not_a_checkpoint_is_one_error_line[empty]`, "
        "`tests/test_readme.py` and `tests/test_readme.py::test_a_citation_of_a_missing_test_is_found`; "
        "not by `tests/test_cli.py::test_that_was_renamed`, `tests/test_gone.py` or "
        "`tests/test_readme.py::test_a_citation_of_a_missing_test_is_found::inner`."
    )
    assert list(missing_tests(text)) == [
        "tests/test_cli.py::test_that_was_renamed",
        "tests/test_gone.py",
        "tests/test_readme.py::test_a_citation_of_a_missing_test_is_found::inner",
    ]
