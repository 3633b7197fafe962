"""On a CUDA device (skipped without one; run where a GPU is lent): background snapshots of CUDA
storages go through pinned buffers and hold the values of the save's moment, and a CUDA fit resumed
by `learn.load` of a mid-fit checkpoint ends bitwise equal to the uninterrupted fit (the optimizer
state kept since the load is put on the training device, as fastai's own `load` does)."""

import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
import pytest
import torch
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.torch_core import set_seed
from torch import nn

import fastai_resume as fr
from fastai_resume.snapshot import BackgroundCommit, SnapshotPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_background_snapshot_of_cuda_storages_holds_the_values_of_its_moment(tmp_path):
    pool = SnapshotPool()
    for rep in range(2):
        w = torch.randn(16 << 20, device="cuda")
        tree = {"w": w, "v": w[1::3], "b": torch.arange(1000.0, device="cuda"), "cpu": torch.randn(1 << 20)}
        ref = {k: t.cpu().clone() for k, t in tree.items()}
        bc = BackgroundCommit(tree, tmp_path / f"{rep}.frk", pool)
        w.mul_(-1)  # training goes on at once
        tree["b"].add_(1)
        tree["cpu"].zero_()
        bc.wait()
        back = fr.load(tmp_path / f"{rep}.frk")
        assert all(torch.equal(back[k].cpu(), ref[k]) for k in ref)
        assert any(b.is_pinned() for _, b in pool._lent if isinstance(b, torch.UntypedStorage))


def learner(path, cbs=()):
    set_seed(0)
    xs, ys = torch.randn(640, 32), torch.randn(640, 1)
    train = DataLoader(list(zip(xs, ys)), bs=32, shuffle=True, drop_last=True)
    valid = DataLoader(list(zip(xs[:64], ys[:64])), bs=32)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 1))
    dls = DataLoaders(train, valid, device="cuda", path=path)
    return Learner(dls, model, loss_func=nn.MSELoss(), path=path, cbs=list(cbs))


def test_a_cuda_fit_resumed_mid_epoch_by_load_is_bitwise_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        ac = fr.AutoCheckpoint(every_iters=7, keep=100, every_epoch=False)
        a = learner(tmp_path, [ac])
        with a.no_bar(), a.no_logging():
            a.fit(3, 1e-3)
        final = {k: v.cpu() for k, v in a.model.state_dict().items()}
        files = ac.checkpoints()
        for f in (files[2], files[-3]):  # mid-epoch, in the second and the third epoch
            b = learner(tmp_path)
            b.load(f.name[: -len(".frk")])
            with b.no_bar(), b.no_logging():
                b.fit(3, 1e-3)
            assert all(torch.equal(v.cpu(), final[k]) for k, v in b.model.state_dict().items()), f.name
            assert len(b.recorder.losses) == len(a.recorder.losses)
    finally:
        torch.use_deterministic_algorithms(False)
