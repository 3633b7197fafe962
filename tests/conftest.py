"""Shared fixtures. The tests import their helpers (`procs`, `trainer`, `workloads`) from this folder
and the package from the checkout; warnings are filtered in pyproject.toml, per source, so the
package's own warnings reach the tests."""

import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
# the CRC32Cs of base files read (fastai_resume.provenance): a folder of this session's (each worker's), every
# script the tests start writes there, none in the user's cache
if not os.environ.get("FASTAI_RESUME_FINGERPRINTS"):
    os.environ["FASTAI_RESUME_FINGERPRINTS"] = tempfile.mkdtemp(prefix="frk-fingerprints-")


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory, worker_id):
    """A folder for the reference runs, shared by the tests of one session and by every pytest-xdist
    worker of it (their temporary folders are siblings): each reference runs once (procs.shared_run)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    return str(root)


@pytest.fixture
def counted(monkeypatch):
    "The bytes the fingerprints read (`io.crc32c_many`), since the last reset (test_provenance, test_unwritten)."
    from fastai_resume import io

    read = [0]
    real = io.crc32c_many

    def counting(buffers, threads):
        read[0] += sum(b.nbytes for b in buffers)
        return real(buffers, threads)

    monkeypatch.setattr(io, "crc32c_many", counting)
    return read
