"""Sharded checkpoints: a model sharded across ranks (FSDP2's `fully_shard`) saved as one file per rank
and a manifest, never as the gathered state; read back at the same world size or at another one.

    models/NAME.frk/                        the checkpoint is a folder (docs/FORMAT.md, "Sharded checkpoints")
        shard-00000-of-00002-<token>.frk    rank 0's file: the local tensor of each of its DTensors (its
        shard-00001-of-00002-<token>.frk    parameter, optimizer-state and gradient shards), each with the
                                            global shape, offset and placement it has; its own buffers
                                            (BatchNorm statistics differ between ranks), RNG, loaders, Recorder
        manifest.frk                        written last, once every rank's file is committed: from then on
                                            the checkpoint exists. Every shard must be there and verify.

Each rank builds and writes its own file (atomic and checksummed, as every checkpoint; a background save
writes it from a thread), with no collective but two small ones: the save's token (a broadcast of 8
bytes) and the outcome (`dist.all_gather_ints`: failed, bytes). Rank 0 then commits the manifest and
removes what a previous save of the same name left. A file's name holds its save's token, so a new save
never overwrites a file of the checkpoint it replaces before its own manifest is committed.

Reading (`read`): at the same world size each rank reads only its own file; the local tensors become the
live model's DTensors again (`DTensor.from_local`, no collective). At another world size, or into a model
that is not sharded, each tensor this rank needs is rebuilt from the saved chunks that overlap it
(`shardfiles.Shards.region`: shard files mapped, each blob verified when first read); the training
position then moves to the new world size counted in samples (`session.continue_at`). A file checkpoint
(one process, DDP) read into a sharded model gives each rank its own part of each full tensor. What is
read without a model (the manifest, a folder's problems, the whole state gathered) is `shardfiles`'.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import torch

from . import checkpoint, dist, io, paths, shardfiles, stored
from .io import CheckpointError
from .paths import MANIFEST
from .shardfiles import SCHEMA, shard_name
from .snapshot import BackgroundCommit

__all__ = [
    "MANIFEST",
    "commit",
    "read",
    "save_model",
    "localize",
]

# ---- DTensors ---------------------------------------------------------------------------------------


def _dtensor_mod():
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(v) -> bool:
    mod = _dtensor_mod()
    return mod is not None and isinstance(v, mod.DTensor)


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


def _reshard(model) -> None:
    "Every FSDP2 module of `model` back to its sharded parameters (after a forward that kept them whole; local)."
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if model is None or fsdp is None:
        return
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()


# ---- writing ----------------------------------------------------------------------------------------


def _token() -> int:
    "A random 64-bit id of one save, the same on every rank (rank 0's). Collective."
    t = secrets.randbits(63) + 1 if dist.rank() == 0 else 0
    return dist.all_gather_ints("sharded save: its token", [t])[0][0]


def _rank_tree(tree: dict, token: int) -> dict:
    local, entries = localize(tree)
    local["shard"] = {"rank": dist.rank(), "world_size": dist.world(), "token": token, "dtensors": entries}
    return local


def _remove_leftovers(folder: Path, keep_token: int, rank: int | None = None) -> None:
    """Shard files of other saves of this folder (the checkpoint replaced, saves that never finished), dead
    temps; `rank`: only that rank's files (each rank's on a disk of its own node, which rank 0 never sees)."""
    stored.remove_dead_temps(folder)
    for p in folder.iterdir():
        m = shardfiles.SHARD_FILE.match(p.name)
        if m is not None and int(m[3], 16) != keep_token and (rank is None or int(m[1]) == rank):
            try:
                p.unlink()
            except OSError:
                pass


def _position(tree: dict | None) -> dict | None:
    train = tree.get("train") if isinstance(tree, dict) else None
    return dict(train["position"]) if isinstance(train, dict) and isinstance(train.get("position"), dict) else None


def _finish(path: Path, token: int, exc: BaseException | None, nbytes: int, position, kind: str) -> None:
    """Every rank has tried to commit its file of save `token`: agree on the outcome, then rank 0 commits
    the manifest. Collective; every rank returns once the manifest is committed, or raises."""
    why = None if exc is None else f"{type(exc).__name__}: {exc}"
    rows = dist.exchange(f"sharded save {path.name}: every rank's file", [why, nbytes])
    bad = [r for r, row in enumerate(rows) if row[0] is not None]
    if bad:
        if exc is not None:
            raise exc
        raise CheckpointError(
            f"the checkpoint {path} was not saved (rank {bad[0]}: {rows[bad[0]][0]}); the previous checkpoint is intact"
        )

    def manifest():
        if dist.rank() != 0:
            return
        n = len(rows)
        io.save(
            {
                "fastai_resume_sharded": SCHEMA,
                "kind": kind,
                "token": token,
                "world_size": n,
                "shards": [{"rank": r, "file": shard_name(r, n, token), "size": rows[r][1]} for r in range(n)],
                "position": position,
            },
            path / MANIFEST,
        )
        _remove_leftovers(path, token)

    dist.together(
        f"sharded save {path.name}: its manifest",
        manifest,
        f"the checkpoint {path} was not saved (rank {{rank}} could not write its manifest: {{why}})",
    )
    if dist.rank() != 0:  # a node's own disk: this rank's files of the saves this one replaces
        _remove_leftovers(path, token, dist.rank())


def _kind(tree) -> str:
    if not isinstance(tree, dict):
        return "other"
    return "end" if "end" in tree else "checkpoint" if tree.get("train") is not None else "model"


def commit_checkpoint(build, path: Path, model=None) -> None:
    "A checkpoint's commit, on every rank: a sharded `model`'s as `commit` writes it, any other by `checkpoint.commit`."
    if dist.sharded(model):
        return commit(build, path, model)
    return checkpoint.commit(build, path)


def commit(build, path: Path, model=None) -> None:
    """Every rank writes its part of the tree `build()` returns (its DTensors' local tensors, its own
    state) to its file in the folder `path`, then rank 0 commits the manifest. Called on every rank
    (`commit_checkpoint` sends a sharded model's saves here); returns once the checkpoint exists, or
    raises on every rank with the first failing rank's reason. The previous checkpoint at `path` stays
    valid until the new manifest replaces it."""
    path = Path(path)
    _reshard(model)
    token = _token()
    exc, nbytes, position, kind = None, 0, None, "other"
    try:
        tree = build()
        position, kind = _position(tree), _kind(tree)
        tree = _rank_tree(tree, token)
        path.mkdir(parents=True, exist_ok=True)
        nbytes = io.save(tree, path / shard_name(dist.rank(), dist.world(), token))
    except Exception as e:  # every rank must hear of it, or the others wait forever
        if not dist.active():
            raise
        exc = e
    _finish(path, token, exc, nbytes, position, kind)


def save_model(learn, file, with_opt: bool = True) -> Path:
    "`learn.save(file)` of a sharded model: a sharded checkpoint of the model (and optimizer), no position."
    path = paths.with_ext(paths.resolve(learn, file))
    commit(lambda: checkpoint.model_tree(learn, with_opt), path, learn.model)
    return path


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
        if len(path) == 2 and path[0] == "model":
            return self.sd.get(path[1])
        if len(path) >= 4 and path[0] == "opt" and path[1] == "state" and isinstance(path[2], int):
            return self.opt_params[path[2]] if 0 <= path[2] < len(self.opt_params) else None
        if len(path) == 3 and path[0] == "train" and path[1] == "grads" and isinstance(path[2], int):
            return self.params[path[2]] if 0 <= path[2] < len(self.params) else None
        return None

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


def _distribute(tree: dict, live: _Live, where) -> None:
    "A file checkpoint's full tensors (model, optimizer state, pending gradients) as this rank's DTensors, in place."
    from torch.distributed.tensor import DTensor

    def visit(path, v):
        if not isinstance(v, torch.Tensor) or isinstance(v, DTensor):
            return
        like = live.like(path)
        if like is None or not is_dtensor(like) or tuple(v.shape) != tuple(like.shape):
            return  # a buffer (per rank, whole), a scalar state
        size, offset = _chunk(v.shape, like.device_mesh, like.placements)
        part = v[tuple(slice(o, o + n) for o, n in zip(offset, size))].clone()
        shardfiles.set_at(
            tree, path, _as_dtensor(part, v.shape, like.device_mesh, list(like.placements), like.to_local().device)
        )

    for name, v in list((tree.get("model") or {}).items()):
        visit(("model", name), v)
    states = (tree.get("opt") or {}).get("state")
    items = states.items() if isinstance(states, dict) else enumerate(states or [])
    for i, st in list(items):
        if isinstance(st, dict):
            for k, v in list(st.items()):
                visit(("opt", "state", i, k), v)
    grads = (tree.get("train") or {}).get("grads")
    for i, g in enumerate(grads or []):
        visit(("train", "grads", i), g)


def read(path, learn) -> dict:
    """The checkpoint at `path` (a file, or a sharded checkpoint's folder), validated, as `learn`'s model
    takes it: a sharded model gets DTensors of this rank's part of each tensor, a model that is not sharded
    whole tensors. At the saved world size each rank reads only its own file. A folder is read by every
    rank together (a collective, as its save): one rank's error is raised on every rank."""
    path = Path(path)
    _reshard(learn.model)  # (its parameters as the DTensors it keeps between batches)
    if not path.is_dir():
        tree = checkpoint.read(path)
        if dist.sharded(learn.model):
            _distribute(tree, _Live(learn), path)
        return tree
    live = _Live(learn)
    # (nodes with disks of their own: the manifest is on rank 0's, each rank's file on its own node's)
    with dist.fetch_missing(f"read {path.name}: its manifest", path / MANIFEST) as manifest:
        return dist.together(
            f"read {path.name}",
            lambda: _read_folder(path, live, manifest),
            f"{path}: rank {{rank}} could not read its part: {{why}}",
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


# ---- AutoCheckpoint --------------------------------------------------------------------------------


class Inflight:
    "A background save of a sharded model: this rank's file being written, then the manifest."

    def __init__(self, writer, error, token: int, position, path: Path):
        self.writer, self.error, self.token, self.position, self.path = writer, error, token, position, path

    @property
    def writing(self) -> bool:
        return self.writer is not None and not self.writer.done


def is_inflight(inflight) -> bool:
    return inflight is not None and isinstance(inflight[0], Inflight)


def writing(saves) -> int:
    "Bit 8 of AutoCheckpoint's agreed flags: this rank's file of the save in flight is still being written."
    return 8 if is_inflight(saves.inflight) and saves.inflight[0].writing else 0


def autosave(saves, learn, files, path: Path, background: bool):
    """AutoCheckpoint's save of a sharded model (`autosave.Saves`), on every rank: synchronous (every rank
    returns once the manifest is committed) or in the background (each rank's file from a thread; the
    manifest once every rank's is written, at the first batch where all agree on it: `after_agreement`)."""
    if not background:
        try:
            commit(lambda: checkpoint.build_tree(learn, with_opt=True, with_iter=True), path, learn.model)
        except Exception as e:
            saves.fail(f"AutoCheckpoint: the save of {path} failed: {e}. The previous checkpoints are intact.", e)
            return None
        saves.committed(path, files, every_rank=True)
        return path
    _reshard(learn.model)
    token = _token()
    writer = err = position = None
    try:
        tree = checkpoint.build_tree(learn, with_opt=True, with_iter=True) or {}
        position = _position(tree)
        tree = _rank_tree(tree, token)
        path.mkdir(parents=True, exist_ok=True)
        writer = BackgroundCommit(tree, os.fspath(path / shard_name(dist.rank(), dist.world(), token)), saves.pool)
    except Exception as e:  # said at the agreement, on every rank
        if not dist.active():
            raise
        err = e
    saves.inflight = (Inflight(writer, err, token, position, path), path)
    return path


def after_agreement(saves, files, flags: int) -> None:
    "Every rank has agreed on `flags`: when no rank's file is still being written, the manifest."
    if is_inflight(saves.inflight) and not flags & 8:
        check_inflight(saves, files, block=True)


def check_inflight(saves, files, block: bool, last: bool = False) -> None:
    """AutoCheckpoint's check of a sharded save in flight: only where every rank calls it (`block`: at an
    agreed batch, a new save, the fit's end) it waits for this rank's file, agrees, and commits the manifest."""
    if not block:
        return
    inf, path = saves.inflight
    saves.inflight = None
    err, nbytes = inf.error, 0
    if inf.writer is not None:
        try:
            nbytes = inf.writer.wait() or 0
        except Exception as e:
            err = e
    try:
        _finish(path, inf.token, err, nbytes, inf.position, "checkpoint")
    except Exception as e:
        saves.fail(f"AutoCheckpoint: background save of {path} failed: {e}. The previous checkpoints are intact.", e)
        return
    saves.committed(path, files, every_rank=True)


def abandon(saves) -> None:
    "After an interrupted fit (the other ranks may be gone): wait for this rank's file, commit no manifest."
    if is_inflight(saves.inflight):
        inf, _ = saves.inflight
        saves.inflight = None
        if inf.writer is not None:
            try:
                inf.writer.wait()
            except Exception:
                pass
