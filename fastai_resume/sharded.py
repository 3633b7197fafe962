"""Sharded checkpoints: a model sharded across ranks (FSDP2's `fully_shard`) saved as one file per rank
and a manifest, never as the gathered state; read back at the same world size or at another one.

    models/NAME.frk/                        the checkpoint is a folder (docs/FORMAT.md, "Sharded checkpoints")
        shard-00000-of-00002-<token>.frk    rank 0's file: the local tensor of each of its DTensors (its
        shard-00001-of-00002-<token>.frk    parameter, optimizer-state and gradient shards), each with the
                                            global shape, offset and placement it has; its own buffers
                                            (BatchNorm statistics differ between ranks), RNG, loaders, Recorder
        manifest.frk                        written last, once every rank's file is committed: from then on
                                            the checkpoint exists. Every shard must be there and verify.

Here are the DTensor mechanics: a rank's file holds its DTensors' local tensors and where each lies
(`rank_tree`); `store` writes the files and the manifest (the save's layout, synchronous or background).

Reading (`read_folder`): at the same world size each rank reads only its own file; the local tensors become the
live model's DTensors again (`DTensor.from_local`, no collective). At another world size, or into a model
that is not sharded, each tensor this rank needs is rebuilt from the saved chunks that overlap it
(`shardfiles.Shards.region`: shard files mapped, each blob verified when first read); the training
position then moves to the new world size counted in samples (`session.continue_at`). A file checkpoint
(one process, DDP) read into a sharded model gives each rank its own part of each full tensor. What is
read without a model (the manifest, a folder's problems, the whole state gathered) is `shardfiles`'.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import checkpoint, dist, io, shardfiles
from .dist import is_dtensor
from .io import CheckpointError
from .paths import MANIFEST

__all__ = ["localize", "rank_tree", "reshard", "read_folder", "distribute"]

# ---- DTensors ---------------------------------------------------------------------------------------


def _placements(v, where: str) -> list:
    "A DTensor's placements as stored: ['shard', dim] or ['replicate'] per mesh dimension."
    out: list = []
    for p in v.placements:
        kind = type(p).__name__
        if kind == "Shard":
            out.append(["shard", int(p.dim)])
        elif kind == "Replicate":
            out.append(["replicate"])
        else:  # Partial (a pending reduction), _StridedShard (FSDP with tensor parallelism)
            raise TypeError(f"{where}: a DTensor placed as {p} is not storable (Shard and Replicate are)")
    return out


def _chunk(shape, mesh, placements) -> tuple:
    "(local shape, global offset) of this rank's part of a tensor of global `shape` so placed."
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(int(x) for x in local), tuple(int(x) for x in offset)


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def localize(tree) -> tuple:
    """`tree` with every DTensor replaced by its local tensor, and one entry per DTensor replaced:
    `{"path": [keys], "shape": global shape, "offset": this rank's global offset, "placements": ...,
    "mesh": mesh shape}`. Nothing is copied and nothing is collective."""
    entries: list = []

    def leaf(v, path):
        if is_dtensor(v):
            where = ".".join(map(str, path))
            local = v.to_local()
            shape, offset = _chunk(v.shape, v.device_mesh, v.placements)
            if tuple(local.shape) != shape:
                raise TypeError(f"{where}: local tensor {tuple(local.shape)}, its placement says {shape}")
            entries.append(
                {
                    "path": list(path),
                    "shape": [int(x) for x in v.shape],
                    "offset": list(offset),
                    "placements": _placements(v, where),
                    "mesh": [int(x) for x in v.device_mesh.shape],
                }
            )
            return local.detach()
        return v

    return io.map_tree(tree, leaf, ()), entries


def reshard(model) -> None:
    "Every FSDP2 module of `model` back to its sharded parameters (after a forward that kept them whole; local)."
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if model is None or fsdp is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()


def rank_tree(tree: dict, token: int) -> dict:
    "This rank's file of a sharded save `token`: `tree` with its DTensors' local tensors, and where each lies."
    local, entries = localize(tree)
    local["shard"] = {"rank": dist.rank(), "world_size": dist.world(), "token": token, "dtensors": entries}
    return local


# ---- reading ----------------------------------------------------------------------------------------


class _Live:
    "What the learner's model is made of now: the live tensor each saved DTensor becomes part of."

    def __init__(self, learn):
        from fastai.torch_core import get_model

        self.model = get_model(learn.model)
        self.sd = self.model.state_dict()
        self.params = list(learn.model.parameters())
        opt = getattr(learn, "opt", None)
        groups = getattr(opt, "param_lists", getattr(opt, "param_groups", [])) if opt is not None else []
        self.opt_params = [p for pg in groups for p in (pg["params"] if isinstance(pg, dict) else pg)]

    def like(self, path):
        "The live tensor the value at `path` is (a parameter, a buffer), or belongs to (a gradient, a state), or None."
        slot = checkpoint.slot(path)
        if slot is None:
            return None
        kind, key = slot
        if kind == "model":
            return self.sd.get(key)
        seq = self.opt_params if kind == "opt" else self.params
        return seq[key] if 0 <= key < len(seq) else None

    def part(self, path, shape, where):
        """Where this rank's part of a tensor of global `shape` saved at `path` lies now: (local size, offset,
        mesh, placements, device); mesh None: the whole tensor (a model that is not sharded). A saved tensor
        that is no tensor of this model (in name or shape) is refused: nothing is allocated for it."""
        live = self.like(path)
        key = ".".join(map(str, path))
        if live is None:
            raise CheckpointError(f"{where}: {key}: saved as a sharded tensor; this model has no such tensor")
        if tuple(live.shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: {key}: shape {tuple(shape)} in the file, {tuple(live.shape)} in this model"
            )
        if is_dtensor(live):
            size, offset = _chunk(shape, live.device_mesh, live.placements)
            return size, offset, live.device_mesh, list(live.placements), live.to_local().device
        return tuple(shape), (0,) * len(shape), None, None, live.device


def _as_dtensor(t, shape, mesh, placements, device):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t.to(device), mesh, placements, run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def distribute(tree: dict, learn, where) -> None:
    """A file checkpoint's full tensors (model, optimizer state, pending gradients) as this rank's DTensors of
    `learn`'s sharded model, in place."""
    from torch.distributed.tensor import DTensor

    reshard(learn.model)  # (its parameters as the DTensors it keeps between batches)
    live = _Live(learn)
    for path, v in checkpoint.tensor_slots(tree):
        if not isinstance(v, torch.Tensor) or isinstance(v, DTensor):
            continue
        like = live.like(path)
        if like is None or not is_dtensor(like) or tuple(v.shape) != tuple(like.shape):
            continue  # a buffer (per rank, whole), a scalar state
        size, offset = _chunk(v.shape, like.device_mesh, like.placements)
        part = v[tuple(slice(o, o + n) for o, n in zip(offset, size))].clone()
        shardfiles.set_at(
            tree, path, _as_dtensor(part, v.shape, like.device_mesh, list(like.placements), like.to_local().device)
        )


def read_folder(path: Path, learn) -> dict:
    """The sharded checkpoint in the folder `path`, validated, as `learn`'s model takes it: a sharded model gets
    DTensors of this rank's part of each tensor, a model that is not sharded whole tensors. At the saved world
    size each rank reads only its own file. Read by every rank together (a collective, as its save): one
    rank's error is raised on every rank."""
    reshard(learn.model)
    live = _Live(learn)
    # (nodes with disks of their own: the manifest is on rank 0's, each rank's file on its own node's)
    with dist.fetch_missing(f"read {path.name}: its manifest", path / MANIFEST) as manifest:
        return dist.together(
            f"read {path.name}",
            lambda: _read_folder(path, live, manifest),
            f"{path}: not every rank could read its part ({{failures}})",
        )


def _read_folder(path: Path, live: _Live, manifest: Path) -> dict:
    _, tree, entries, shards = shardfiles.open_folder(path, manifest=manifest)
    for e in entries:
        t = shards.files[shards.own][0][tuple(e["path"])]
        size, offset, mesh, placements, device = live.part(e["path"], e["shape"], path)
        if tuple(offset) == tuple(e["offset"]) and tuple(size) == tuple(t.shape):
            part = t  # this rank's own chunk (the file was read into memory of this process's own)
        else:
            part = shards.region(e["path"], e["shape"], offset, size)
        if mesh is not None:
            part = _as_dtensor(part, e["shape"], mesh, placements, device)
        shardfiles.set_at(tree, e["path"], part)
    return tree
