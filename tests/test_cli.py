"""The command-line tool, the demo's pieces, and the notebook (executed top to bottom)."""
import os
import subprocess
import sys

import pytest
import torch

import fastai_resume as fr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_resume_rules import StopAt  # noqa: E402
from trainer import build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "fastai_resume", *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=ROOT))
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    learn = build(d, noise=False)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2, cbs=StopAt(1, 10))
    return d / "models" / "ck.frk"


def test_inspect_shows_position_tensors_and_verification(ckpt):
    rc, out, _ = cli("inspect", ckpt)
    assert rc == 0
    assert "all checksums verify" in out and "epoch 1 of 3, 10 of 46 training batches done" in out
    assert "model.0.weight" in out and "torch.float32" in out and "[128, 64]" in out


def test_verify_reports_each_file_and_fails_on_a_bad_one(ckpt, tmp_path):
    good = tmp_path / "good.frk"
    good.write_bytes(ckpt.read_bytes())
    data = bytearray(ckpt.read_bytes())
    data[200] ^= 1
    (tmp_path / "bad.frk").write_bytes(bytes(data))
    rc, out, _ = cli("verify", good)
    assert rc == 0 and out.startswith("OK")
    rc, out, _ = cli("verify", tmp_path)
    assert rc == 1 and "BAD" in out and "bad.frk" in out and "OK   " in out


def test_errors_are_one_line_not_a_traceback(tmp_path):
    (tmp_path / "junk.frk").write_bytes(b"\x89FRK\r\n\x1a\n" + b"\x00" * 10)
    rc, out, err = cli("inspect", tmp_path / "junk.frk")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and "too short" in err
    rc, _, err = cli("inspect", tmp_path / "missing.frk")
    assert rc == 2 and "No such file" in err and "Traceback" not in err


def test_convert_to_vanilla_pth_and_back(ckpt, tmp_path):
    rc, out, err = cli("convert", ckpt, tmp_path / "deploy.pth")
    assert rc == 0, err
    learn = build(tmp_path, noise=False)
    learn.load(tmp_path / "deploy")  # fastai's own loader
    ref = fr.load(ckpt)["model"]
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in ref.items())
    rc, _, err = cli("convert", tmp_path / "deploy.pth", tmp_path / "back.frk")
    assert rc == 0, err
    back = fr.load(tmp_path / "back.frk")
    assert all(torch.equal(v, back["model"][k]) for k, v in ref.items()) and "train" not in back


def test_the_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel is a new process
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "identical to the uninterrupted run: True" in outputs
