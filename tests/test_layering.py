"""The module map at the top of `fastai_resume/__init__.py` is true: each module imports only the modules
listed before it (at module level and inside functions alike: the map names no lazy edge), and only `io`
imports the C core (`_core`). Read from the sources (ast), nothing imported."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fastai_resume"
NAME = "fastai_resume"
MODULES = {p.stem for p in PACKAGE.glob("*.py")} | {"_core"}  # (`from . import x`: a module, or a name of __init__)


def module_map(init_source: str) -> list:
    """The modules of the map in `__init__`'s docstring, bottom up: the first column of its indented lines
    (`io.py`, `_core (csrc/)`, several on one line in their order)."""
    doc = ast.get_docstring(ast.parse(init_source), clean=False) or ""
    order: list = []
    for line in doc.splitlines():
        m = re.match(r"    (\S.*?)(?:\s{2,}|$)", line)
        if m:
            order += re.findall(r"(\w+)(?:\.py|\s\(csrc/\))", m[1])
    return order


def _target(module: str | None, level: int, names: list, known) -> list:
    "The package's modules an import statement imports (`from . import x` of a name that is no module: `__init__`)."
    if level > 1:
        return ["<outside the package>"]
    if level == 0:
        if module is None or (module != NAME and not module.startswith(NAME + ".")):
            return []  # not ours
        module = module[len(NAME) + 1 :] or None
    if module:
        return [module.split(".")[0]]
    return [n if n in known else "__init__" for n in names] or ["__init__"]  # (`import fastai_resume`)


def imports(source: str, known) -> list:
    "(line, module) for every import of one of the package's modules in `source`, at any depth."
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            got = _target(node.module, node.level, [a.name for a in node.names], known)
        elif isinstance(node, ast.Import):
            got = [t for a in node.names for t in _target(a.name, 0, [], known)]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            spec = node.args[0].value
            level = len(spec) - len(spec.lstrip("."))
            got = _target(spec.lstrip(".") or None, level, [], known)
        else:
            continue
        out += [(node.lineno, t) for t in got]
    return out


def problems(name: str, source: str, order: list) -> list:
    "What module `name` (its `source`) imports against the map `order`."
    known = set(order)
    if name not in known:
        return [f"{name}.py: not in the map"]
    found = []
    for line, target in imports(source, known | MODULES):
        if target == "_core" and name != "io":
            found.append(f"{name}.py:{line}: imports _core (only io talks to the C core)")
        elif target not in known:
            found.append(f"{name}.py:{line}: imports {target}, which the map does not list")
        elif order.index(target) >= order.index(name):
            found.append(f"{name}.py:{line}: imports {target}, listed after it in the map")
    return found


@pytest.fixture(scope="module")
def order():
    return module_map((PACKAGE / "__init__.py").read_text())


def test_the_map_lists_every_module_of_the_package_once(order):
    assert order[:2] == ["_core", "io"]
    assert len(order) == len(set(order)), [m for m in order if order.count(m) > 1]
    assert set(order) == MODULES, (sorted(MODULES - set(order)), sorted(set(order) - MODULES))
    assert (PACKAGE / "_core.pyi").is_file()


def test_every_module_imports_only_modules_listed_before_it(order):
    found = [p for f in sorted(PACKAGE.glob("*.py")) for p in problems(f.stem, f.read_text(), order)]
    assert found == []


# ---- the checker's negative controls: each breach of the map, planted in a module's source, is reported ----


def test_an_upward_import_is_reported(order):
    assert problems("paths", "from . import autosave\n", order) == [
        "paths.py:1: imports autosave, listed after it in the map"
    ]
    assert problems("paths", "from .sharded import read\n", order) == [
        "paths.py:1: imports sharded, listed after it in the map"
    ]
    assert problems("paths", "import fastai_resume.remote as r\n", order) == [
        "paths.py:1: imports remote, listed after it in the map"
    ]


def test_an_upward_import_inside_a_function_is_reported(order):
    src = "def f():\n    if True:\n        from . import session\n    return session\n"
    assert problems("checkpoint", src, order) == ["checkpoint.py:3: imports session, listed after it in the map"]
    src = "import importlib\n\ndef f():\n    return importlib.import_module('.patches', __package__)\n"
    assert problems("paths", src, order) == ["paths.py:4: imports patches, listed after it in the map"]


def test_an_import_of_the_c_core_outside_io_is_reported(order):
    assert problems("session", "from . import _core\n", order) == [
        "session.py:1: imports _core (only io talks to the C core)"
    ]
    assert problems("sharded", "from ._core import Mapping\n", order) == [
        "sharded.py:1: imports _core (only io talks to the C core)"
    ]
    assert problems("io", "from . import _core\n", order) == []


def test_an_import_of_a_module_the_map_does_not_list_is_reported(order):
    assert problems("paths", "from . import EXT\n", order) == [
        "paths.py:1: imports __init__, listed after it in the map"
    ]
    assert problems("autosave", "from .nowhere import x\n", order) == [
        "autosave.py:1: imports nowhere, which the map does not list"
    ]


def test_imports_of_modules_listed_before_and_of_other_packages_are_not_reported(order):
    src = "import os\nimport torch\nfrom fastai.learner import Learner\nfrom . import io, paths\nfrom .io import EXT\n"
    assert problems("sharded", src, order) == []
    assert problems("demo", "def main():\n    import fastai_resume\n", order) == []
    assert problems("paths", "import fastai_resume\n", order) == [
        "paths.py:1: imports __init__, listed after it in the map"
    ]


def test_the_map_is_read_in_its_order_several_modules_on_one_line_too():
    doc = '"""x\n\n    _core (csrc/), io.py   a\n    b.py, c.py,            b\n    d.py                   c\n                           d\n"""\n'
    assert module_map(doc) == ["_core", "io", "b", "c", "d"]
    assert problems("c", "from . import b\n", ["_core", "io", "b", "c"]) == []
    assert problems("b", "from . import c\n", ["_core", "io", "b", "c"]) == [
        "b.py:1: imports c, listed after it in the map"
    ]
