"""Shared fixtures. The tests import their helpers (`procs`, `trainer`, `workloads`) from this folder
and the package from the checkout; warnings are filtered in pyproject.toml, per source, so the
package's own warnings reach the tests."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory):
    "A folder for the reference runs, shared by the tests of one session."
    return str(tmp_path_factory.mktemp("runs"))
