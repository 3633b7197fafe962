"""torch.distributed plumbing for resumable data-parallel training (fastai's `distrib_ctx`,
Hugging Face Accelerate, launched by `torchrun` or `accelerate launch`).

Rules: every rank calls `save(with_iter=True)` (as fastai's callbacks do); the ranks' own state
(RNG, DataLoader shuffling state, Recorder) is gathered to rank 0, which alone writes the one
checkpoint file, atomically; every rank returns once the file is committed, or raises with the
others. A decision that could differ between ranks (a time-based checkpoint, a SIGTERM seen by one
rank first, a failed background save) is agreed with one small all-reduce, so that every rank
saves, or stops, at the same batch.

A model sharded with FSDP2 (`sharded`: its parameters are DTensors) is saved the other way: every
rank writes its own file and a manifest is committed last (`fastai_resume.sharded`); the ranks agree
on the outcome with `all_gather_ints`, a few integers each.

"""

from __future__ import annotations

import sys

import torch
import torch.distributed as D

from .fastai_classes import is_a

__all__ = [
    "active",
    "rank",
    "world",
    "gather",
    "broadcast",
    "agree_any",
    "all_gather_ints",
    "sharded",
    "unwrap_dl",
    "is_distributed_dl",
]


def active() -> bool:
    "True inside an initialised process group of more than one process."
    return D.is_available() and D.is_initialized() and D.get_world_size() > 1


def rank() -> int:
    return D.get_rank() if active() else 0


def world() -> int:
    return D.get_world_size() if active() else 1


_ctl: dict = {}


def _group():
    """The process group for this module's small control messages: the default group when it is
    gloo, else a gloo group over the same ranks (created once, collectively, on first use), so
    that no control message costs a CUDA synchronisation or GPU memory."""
    if D.get_backend() == "gloo":
        return None
    world = D.group.WORLD
    if _ctl.get("world") is not world:
        _ctl.update(world=world, group=D.new_group(backend="gloo"))
    return _ctl["group"]


def gather(obj) -> list | None:
    "Every rank's `obj`, in rank order, on rank 0 (None on the others). Collective."
    if not active():
        return [obj]
    out = [None] * D.get_world_size() if D.get_rank() == 0 else None
    D.gather_object(obj, out, dst=0, group=_group())
    return out


def broadcast(obj, src: int = 0):
    "Rank `src`'s `obj` on every rank. Collective."
    if not active():
        return obj
    box = [obj]
    D.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def agree_any(flags: int) -> int:
    "The bitwise OR of every rank's `flags` (bits 0-7; sent as 8 int32, 32 bytes). Collective."
    if not active():
        return flags
    t = torch.tensor([(flags >> i) & 1 for i in range(8)], dtype=torch.int32)
    D.all_reduce(t, op=D.ReduceOp.MAX, group=_group())
    return sum(int(b) << i for i, b in enumerate(t.tolist()))


def all_gather_ints(values: list) -> list:
    "Every rank's list of int64 `values` (the same length on each), in rank order. Collective."
    if not active():
        return [list(values)]
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(D.get_world_size())]
    D.all_gather(out, t, group=_group())
    return [o.tolist() for o in out]


def sharded(model) -> bool:
    """Is `model` sharded across ranks: FSDP2's `fully_shard` made a module of it an `FSDPModule` (its
    parameters are DTensors, except while a forward holds them whole), or a parameter is a DTensor? Neither
    can exist before torch imports them: without them nothing is imported here."""
    if model is None:
        return False
    fsdp, tensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        return True
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


def is_distributed_dl(dl) -> bool:
    "Is `dl` fastai's `DistributedDL` (or a subclass)?"
    return is_a(dl, "fastai.distributed", "DistributedDL")


def unwrap_dl(dl):
    "The DataLoader that owns the shuffling RNG: fastai's `DistributedDL` wraps the user's one."
    while is_distributed_dl(dl) and hasattr(dl, "dl"):
        dl = dl.dl
    return dl
