"""The fastai releases the package claims: a clear warning outside them, and a loud failure when the
installed fastai changes a function the package replaces or relies on. `make compat` runs this file
and the exactness tests once per release in `compat.TESTED_FASTAI`."""

import os
import shutil
import warnings

import fastai
import pytest

from fastai_resume import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_packages_under_test_are_the_ones_make_compat_installed():
    "`make compat` puts each row's packages first on PYTHONPATH; this checks they are the ones imported."
    import importlib

    pkgs = os.environ.get("FRK_COMPAT_PKGS")
    if pkgs is None:
        pytest.skip("not under make compat")
    for spec in pkgs.split():
        name, version = spec.split("==")
        mod = importlib.import_module(name)
        assert mod.__version__ == version
        assert os.path.realpath(mod.__file__).startswith(os.path.realpath(os.path.join(ROOT, "build", "compat")))


def test_installed_fastai_is_in_the_tested_range_and_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_fastai_version() is True
    assert fastai.__version__ in compat.TESTED_FASTAI


@pytest.mark.parametrize("version", ["2.7.19", "2.8.8", "2.8.13", "2.9.0", "3.0.0"])
def test_untested_fastai_warns_with_the_version_the_range_and_what_may_break(version):
    with pytest.warns(compat.FastaiVersionWarning) as rec:
        assert compat.check_fastai_version(version) is False
    msg = str(rec[0].message)
    assert f"fastai {version} is installed" in msg
    assert f"tested with fastai {compat.TESTED_FASTAI[0]} to {compat.TESTED_FASTAI[-1]}" in msg
    assert "Learner._do_fit" in msg and "may differ from the uninterrupted one" in msg


@pytest.mark.parametrize("version", ["2.8.9", "2.8.10", "2.8.12"])
def test_tested_fastai_versions_do_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_fastai_version(version) is True


def _dependencies():
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return project, {r.name: r for r in map(Requirement, project["dependencies"])}


def test_pyproject_claims_the_oldest_tested_fastai_and_no_upper_bound_on_any_dependency():
    """A newer fastai, fastcore or torch installs (fastai's then warns, above): no dependency of the
    package caps a release, so installing it never downgrades a user's fastai or torch."""
    project, deps = _dependencies()
    assert str(deps["fastai"].specifier) == f">={compat.TESTED_FASTAI[0]}"
    assert {"fastai", "fastcore", "torch", "numpy"} <= set(deps)
    for r in deps.values():
        assert all(s.operator == ">=" for s in r.specifier), r
    assert project["requires-python"] == ">=3.11"


def test_the_running_python_is_one_pyproject_claims():
    import sys

    project, _ = _dependencies()
    claimed = [
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in claimed


def test_the_package_under_test_is_the_installed_wheel():
    """`make matrix` installs the built wheel into a clean venv and runs this file from a copy of the
    checkout without the package: here, and in a child started as the CLI tests start theirs
    (PYTHONPATH = the checkout), `fastai_resume` is the wheel's, from the venv's site-packages."""
    import importlib.metadata as md
    import subprocess
    import sys
    import sysconfig

    import fastai_resume
    from fastai_resume import _core

    wheel = os.environ.get("FRK_MATRIX_WHEEL")
    if wheel is None:
        pytest.skip("not under make matrix")
    site = os.path.realpath(sysconfig.get_paths()["platlib"])
    assert not os.path.exists(os.path.join(ROOT, "fastai_resume"))
    for f in (fastai_resume.__file__, _core.__file__):
        assert os.path.realpath(f).startswith(site + os.sep), f
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert os.path.basename(wheel).startswith(f"fastai_resume-{fastai_resume.__version__}-{tag}-{tag}-")
    assert md.version("fastai-resume") == fastai_resume.__version__
    child = subprocess.run(
        [sys.executable, "-c", "import fastai_resume._core as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        check=True,
    )
    assert os.path.realpath(child.stdout.strip()) == os.path.realpath(_core.__file__)


def test_fastai_functions_the_package_replaces_are_unchanged():
    """Each function whose body the patches copy, or whose attributes the state capture reads, has
    the source recorded for the tested releases. A new fastai that changes one fails here, by name."""
    changed = compat.changed_sources()
    assert changed == [], (
        f"fastai {fastai.__version__} changed {changed}: compare them with what "
        "fastai_resume replaces, then record the new hashes in compat.REPLACED_SOURCES"
    )


def test_sources_are_read_from_fastais_files_not_from_the_patched_classes():
    from fastai.learner import Learner

    srcs = compat.fastai_sources()
    assert srcs["Learner._do_fit"].startswith("def _do_fit(self):") and "_frk" not in srcs["Learner._do_fit"]
    assert "fastai_resume" in Learner._do_fit.__code__.co_filename  # the live method is the patched one
    assert srcs["save"].startswith("def save(self:Learner, file")


def test_negative_control_a_changed_function_is_named(tmp_path):
    root = tmp_path / "fastai"
    shutil.copytree(os.path.dirname(fastai.__file__), root, ignore=shutil.ignore_patterns("__pycache__"))
    learner = root / "learner.py"
    text = learner.read_text()
    assert text.count("for epoch in range(self.n_epoch):") == 1
    learner.write_text(text.replace("for epoch in range(self.n_epoch):", "for epoch in range(self.n_epoch or 1):"))
    sched = root / "callback" / "schedule.py"
    sched.write_text(sched.read_text().replace("def fit_sgdr(", "def fit_sgdr_renamed("))
    assert compat.changed_sources(str(root)) == ["Learner._do_fit", "fit_sgdr"]


def test_demo_without_scikit_learn_says_in_one_line_how_to_install_it():
    """The demo's data set comes from scikit-learn, declared in the `demo` extra. (fastai 2.8.9-2.8.12
    require scikit-learn themselves, so this guards against a fastai that drops it.)"""
    import subprocess
    import sys

    code = (
        "import sys, fastai_resume; sys.modules['sklearn.datasets'] = None  # as if not installed\n"
        "from fastai_resume.demo import main; main([])"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=ROOT),
    )
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "fastai_resume.demo needs scikit-learn (its bundled digits data set): pip install 'fastai-resume[demo]'"
    ]
    assert 'demo = ["scikit-learn"]' in open(os.path.join(ROOT, "pyproject.toml")).read()
