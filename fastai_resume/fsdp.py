"""Train a fastai Learner whose model is sharded across processes with PyTorch's FSDP2 (`fully_shard`), as
fastai's `distrib_ctx` trains one with DDP: launched by `torchrun`, on the CPU (gloo) or CUDA (NCCL).

    with fsdp_ctx(learn):                 # or learn.fsdp_ctx(), once fastai_resume.fsdp is imported
        learn.load("ckpt")                # (a resume: inside the context, after the model is sharded)
        learn.fit_one_cycle(3, 1e-3, cbs=AutoCheckpoint(every_iters=100))

`fsdp_ctx` sets up the process group when none is (torchrun's environment, or a group of one process),
moves the model to this rank's device, shards it (`shard`: which modules get their own `fully_shard`),
recreates the optimizer over the sharded parameters, and wraps the loaders in fastai's `DistributedDL`
for each fit (each rank trains on its share of every batch list, as under DDP). Inside it `learn.save`,
`learn.load` and `AutoCheckpoint` write and read sharded checkpoints: one file per rank and a manifest
(`fastai_resume.sharded`). On leaving it, the callback goes and a process group it created is destroyed;
the model stays sharded (save inside the context what is to outlive it).

fastai's `distrib_ctx` cannot do this: it wraps the model in DDP (which refuses DTensor parameters), and its
`DistributedDL` moves the index list to CUDA even on the CPU or with one process (`patches.patch_distributed_dl`).
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as D
from fastai.callback.core import Callback
from fastai.learner import Learner
from fastcore.basics import noop, patch_to

from . import dist

__all__ = ["fsdp_ctx", "ShardedTrainer", "shard_model"]


class ShardedTrainer(Callback):
    "Wraps the loaders in fastai's `DistributedDL` for each fit, as fastai's `DistributedTrainer` does under DDP."

    order = 11  # fastai's DistributedTrainer's: before the Recorder and every callback of ours

    def __init__(self, device):
        self.device = device
        self.old_dls = None

    def _wrap(self, dl):
        from fastai.distributed import DistributedDL

        return dl if isinstance(dl, DistributedDL) else DistributedDL(dl, device=self.device)

    def before_fit(self):
        self.old_dls = list(self.dls.loaders)
        self.learn.dls.loaders = [self._wrap(dl) for dl in self.dls.loaders]
        if dist.rank():
            self.learn.logger = noop

    def before_train(self):
        self.learn.dl = self._wrap(self.learn.dl)

    def before_validate(self):
        self.learn.dl = self._wrap(self.learn.dl)

    def after_fit(self):
        if self.old_dls is not None:
            self.learn.dls.loaders, self.old_dls = self.old_dls, None

    after_interrupted_fit = after_fit  # (fastai runs no after_fit when a fit raises; the resume session calls this)


def shard_model(model, mesh, shard=None, **fsdp_kwargs):
    """`fully_shard` the modules `shard` names, then `model` itself (the root), on `mesh`. `shard`: None (each
    direct child that has parameters: the layers of an `nn.Sequential`, a fastai body and head), a module
    class or a tuple of them (every submodule of those classes, e.g. a transformer's blocks), or a callable
    `shard(model, mesh)` that shards as it likes (the root is still sharded after it, if it did not)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if callable(shard) and not isinstance(shard, type):
        shard(model, mesh)
    else:
        if shard is None:
            parts = [c for c in model.children() if any(True for _ in c.parameters())]
        else:
            kinds = shard if isinstance(shard, tuple) else (shard,)
            parts = [m for m in model.modules() if isinstance(m, kinds) and m is not model]
        for m in parts:
            fully_shard(m, mesh=mesh, **fsdp_kwargs)
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _init_group(backend: str) -> None:
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        D.init_process_group(backend)  # torchrun's environment (env://)
    else:  # one process on its own (a notebook, `python train.py`): a group of one
        D.init_process_group(backend, store=D.HashStore(), rank=0, world_size=1)


@contextmanager
def fsdp_ctx(learn, shard=None, cpu: bool = False, backend: str | None = None, **fsdp_kwargs):
    """Train `learn` with its model sharded by FSDP2 across this job's processes (see the module's doc).
    `shard`: which modules get their own `fully_shard` (`shard_model`); `cpu=True` trains on the CPU with
    gloo even where CUDA is present; `backend` overrides the process group's backend (default NCCL on
    CUDA, gloo on the CPU); `fsdp_kwargs` go to every `fully_shard` call (`reshard_after_forward`,
    `mp_policy`, ...)."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available() and not cpu
    made = False
    if not D.is_initialized():
        _init_group(backend or ("nccl" if cuda else "gloo"))
        made = True
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    cb = ShardedTrainer(device)
    progress = None
    try:
        if not dist.sharded(learn.model):
            mesh = init_device_mesh(device.type, (D.get_world_size(),))
            shard_model(learn.model.to(device), mesh, shard, **fsdp_kwargs)
            opt = getattr(learn, "opt", None)
            if opt is not None:  # it holds the parameters that fully_shard has replaced
                if any(len(s) for s in getattr(opt, "state", {}).values()):
                    warnings.warn(
                        "fsdp_ctx: the learner's optimizer had state; it is recreated over the sharded parameters "
                        "without it (shard first, then learn.load a checkpoint, inside the context)",
                        stacklevel=3,
                    )
                learn.opt = None
        learn.dls.device = device
        learn.add_cb(cb)
        if dist.rank():
            from fastai.callback.progress import ProgressCallback

            progress = next((c for c in learn.cbs if isinstance(c, ProgressCallback)), None)
            if progress is not None:
                learn.remove_cb(progress)
        yield learn
    finally:
        learn.remove_cb(cb)
        if progress is not None:
            learn.add_cb(progress)
        if made and D.is_initialized():
            D.destroy_process_group()


def _learner_fsdp_ctx(self, shard=None, cpu: bool = False, backend: str | None = None, **fsdp_kwargs):
    "Train with the model sharded by FSDP2 across the job's processes (`fastai_resume.fsdp.fsdp_ctx`)."
    return fsdp_ctx(self, shard=shard, cpu=cpu, backend=backend, **fsdp_kwargs)


patch_to(Learner, nm="fsdp_ctx")(_learner_fsdp_ctx)
