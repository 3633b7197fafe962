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
(`_Shards.region`: shard files mapped, each blob verified when first read); the training position then
moves to the new world size counted in samples (`continue_at`). A file checkpoint (one process, DDP) read
into a sharded model gives each rank its own part of each full tensor.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import warnings
from pathlib import Path

import torch

from . import _core, checkpoint, dist, io, loaders, paths
from .io import CheckpointError
from .paths import MANIFEST
from .snapshot import BackgroundCommit

__all__ = [
    "MANIFEST",
    "SCHEMA",
    "commit",
    "read",
    "gathered",
    "is_sharded_checkpoint",
    "read_manifest",
    "problem",
    "verify",
    "exists",
    "remove",
    "remove_unfinished",
    "size",
    "continue_at",
    "save_model",
    "shard_name",
    "localize",
]

SCHEMA = 1  # the manifest's own version (its key `fastai_resume_sharded`)
_SHARD = re.compile(r"^shard-(\d{5})-of-(\d{5})-([0-9a-f]{16})\.frk$")


def shard_name(rank: int, world: int, token: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}-{token:016x}.frk"


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

    def walk(v, path):
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
        if isinstance(v, dict):
            return {k: walk(x, (*path, k)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, (*path, i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(walk(x, (*path, i)) for i, x in enumerate(v))
        return v

    return walk(tree, ()), entries


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


def _remove_leftovers(folder: Path, keep_token: int) -> None:
    "Shard files of other saves of this folder (the checkpoint replaced, saves that never finished), dead temps."
    checkpoint.remove_dead_temps(folder)
    for p in folder.iterdir():
        m = _SHARD.match(p.name)
        if m is not None and int(m[3], 16) != keep_token:
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


# ---- the folder -------------------------------------------------------------------------------------


def is_sharded_checkpoint(path) -> bool:
    "Is `path` a folder with a manifest (whether it verifies or not)?"
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def exists(path) -> bool:
    "A checkpoint at `path`: a file, or a folder whose manifest is committed."
    p = Path(path)
    return is_sharded_checkpoint(p) if p.is_dir() else p.exists()


def size(path) -> int:
    "The bytes a checkpoint takes (a folder: all of its files)."
    p = Path(path)
    if not p.is_dir():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def remove(path) -> None:
    "Remove a checkpoint, a file or a folder (its manifest first: from then on it no longer exists)."
    p = Path(path)
    if not p.is_dir():
        p.unlink()
        return
    try:
        (p / MANIFEST).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(p)


def remove_unfinished(folder: Path, names=None) -> int:
    """Remove the sharded checkpoints in `folder` (those whose names `names` accepts) that a killed save left
    without a manifest, and dead writers' temporary files in the others: never a checkpoint, as a dead
    writer's temporary file is not. A folder in which a live process is still writing is left alone."""
    n = 0
    if not folder.is_dir():
        return 0
    for p in folder.iterdir():
        if not p.is_dir() or not p.name.endswith(io.EXT) or (names is not None and not names(p.name)):
            continue
        checkpoint.remove_dead_temps(p)
        if (p / MANIFEST).exists() or any(checkpoint.is_temp(f.name) for f in p.iterdir()):
            continue
        shutil.rmtree(p, ignore_errors=True)
        n += 1
    return n


class _Bad(Exception):
    pass


def _need(ok, what: str) -> None:
    if not ok:
        raise _Bad(what)


def _is_int(v, lo=0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def read_manifest(path) -> dict:
    "The manifest of the sharded checkpoint `path`, validated (its shard files are not opened)."
    p = Path(path)
    mf = p / MANIFEST
    if not mf.is_file():
        raise CheckpointError(
            f"{p}: no {MANIFEST}: not a sharded checkpoint, or a save that did not finish (every rank's "
            "file is committed first, the manifest last)" + (_NOT_SHARED if dist.active() else "")
        )
    m = io.load(mf)
    try:
        _need(isinstance(m, dict) and _is_int(m.get("fastai_resume_sharded"), 1), "not a sharded checkpoint's manifest")
        _need(
            m["fastai_resume_sharded"] <= SCHEMA,
            f"written by a newer fastai_resume (manifest schema {m['fastai_resume_sharded']}): upgrade to read it",
        )
        n, token = m.get("world_size"), m.get("token")
        _need(_is_int(n, 1) and n < 100000, "world_size: expected an int >= 1")
        _need(_is_int(token, 1), "token: expected an int")
        shards = m.get("shards")
        _need(isinstance(shards, list) and len(shards) == n, f"shards: expected a list of {n}")
        for r, s in enumerate(shards):
            _need(
                isinstance(s, dict)
                and s.get("rank") == r
                and s.get("file") == shard_name(r, n, token)
                and _is_int(s.get("size")),
                f"shards[{r}]: expected rank {r}, file {shard_name(r, n, token)} and its size",
            )
        _need(m.get("position") is None or isinstance(m["position"], dict), "position: expected a dict or None")
    except _Bad as e:
        raise CheckpointError(f"{mf}: malformed manifest: {e}") from None
    return m


def _check_shard_meta(tree, path, manifest, rank) -> list:
    "Raise unless the rank file `path` belongs to this manifest as rank `rank`; its DTensor entries."
    where = f"{path}: "
    try:
        _need(isinstance(tree, dict) and isinstance(tree.get("shard"), dict), "no 'shard' part: not a rank's file")
        sh = tree["shard"]
        _need(
            sh.get("rank") == rank
            and sh.get("world_size") == manifest["world_size"]
            and sh.get("token") == manifest["token"],
            f"written as rank {sh.get('rank')} of {sh.get('world_size')} by save {sh.get('token')!r}, "
            f"the manifest wants rank {rank} of {manifest['world_size']} of save {manifest['token']}",
        )
        entries = sh.get("dtensors")
        _need(isinstance(entries, list), "shard.dtensors: expected a list")
        for i, e in enumerate(entries):
            at = f"shard.dtensors[{i}]"
            _need(isinstance(e, dict), f"{at}: expected a dict")
            pth, shp, off, pl, mesh = (e.get(k) for k in ("path", "shape", "offset", "placements", "mesh"))
            _need(
                isinstance(pth, list) and pth and all(isinstance(k, (str, int)) for k in pth),
                f"{at}.path: expected a list of keys",
            )
            _need(isinstance(shp, list) and all(_is_int(x) for x in shp), f"{at}.shape: expected ints")
            _need(
                isinstance(off, list) and len(off) == len(shp) and all(_is_int(x) for x in off),
                f"{at}.offset: expected {len(shp)} ints",
            )
            _need(isinstance(mesh, list) and mesh and all(_is_int(x, 1) for x in mesh), f"{at}.mesh: expected ints")
            _need(
                isinstance(pl, list)
                and len(pl) == len(mesh)
                and all(
                    p == ["replicate"] or (isinstance(p, list) and len(p) == 2 and p[0] == "shard" and _is_int(p[1]))
                    for p in pl
                ),
                f"{at}.placements: expected ['shard', dim] or ['replicate'] per mesh dimension",
            )
    except _Bad as e:
        raise CheckpointError(where + str(e)) from None
    return entries


def _at(tree, path):
    v = tree
    for k in path:
        v = v[k]
    return v


def _set_at(tree, path, value):
    parent = _at(tree, path[:-1])
    if isinstance(parent, tuple):
        raise CheckpointError(f"{'.'.join(map(str, path))}: inside a tuple")
    parent[path[-1]] = value


def _get(tree, path, where):
    try:
        v = _at(tree, path)
    except (KeyError, IndexError, TypeError):
        raise CheckpointError(f"{where}: {'.'.join(map(str, path))} is not in the file") from None
    return v


def _chunk_fits(e, t, where) -> None:
    "A saved chunk: a tensor of its entry's dimensions, inside the global shape."
    key = ".".join(map(str, e["path"]))
    if not isinstance(t, torch.Tensor) or t.dim() != len(e["shape"]):
        raise CheckpointError(f"{where}: {key}: expected a tensor of {len(e['shape'])} dimensions")
    if any(o + n > g for o, n, g in zip(e["offset"], t.shape, e["shape"])):
        raise CheckpointError(f"{where}: {key}: a chunk {tuple(t.shape)} at {e['offset']} outside {e['shape']}")


def problem(path, verify: bool = True) -> str | None:
    """What is wrong with the sharded checkpoint `path` (None: the manifest and every shard are there, belong
    together, hold a well-formed checkpoint and, with `verify`, every checksum of every file verifies)."""
    try:
        d = describe(path, verify)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or path}: {e.strerror or e}"
    for r in d["ranks"]:
        if r["problem"]:
            return f"rank {r['rank']}'s file {r['file']} {r['problem']}"
    return None


def verify(path) -> None:
    "Raise `CheckpointError` unless the checkpoint at `path` (a file or a folder) is complete and verifies."
    p = Path(path)
    if not p.is_dir():
        io.info(p, verify=True)
        return
    why = problem(p, verify=True)
    if why is not None:
        raise (Incomplete if why.endswith(" is missing") else CheckpointError)(
            why if why.startswith(str(p)) else f"{p}: {why}"
        )


class Incomplete(CheckpointError):
    """A sharded checkpoint whose manifest names a rank's file this disk lacks: under torch.distributed, a
    folder that is not shared by the nodes (each rank's file is on its own node's disk), not a corrupt one."""


# ---- reading ----------------------------------------------------------------------------------------


class _Ref:
    "A tensor of a mapped shard file and the blob it lies in."

    __slots__ = ("t", "blob")

    def __init__(self, t, blob):
        self.t, self.blob = t, blob


class _Shard:
    "One rank's file, mapped (not read) until a part is needed; each blob verified when first read."

    def __init__(self, path: Path):
        self.path = path
        self.m = _core.Mapping(os.fspath(path))
        try:
            self.r = _core.Reader(self.m, verify=False)  # (the footer and the index are always checked)
            table = self.r.tensors()
            make = io._decoder(self.m, self.r)
            self.tree = self.r.tree(lambda i: _Ref(make(i), table[i][2]))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        self.verified: set = set()

    def tensor(self, path: list) -> torch.Tensor:
        ref = _get(self.tree, path, self.path)
        if not isinstance(ref, _Ref):
            raise CheckpointError(f"{self.path}: {'.'.join(map(str, path))}: expected a tensor")
        if ref.blob not in self.verified:
            try:
                self.r.verify_blob(ref.blob)
            except CheckpointError as e:
                raise CheckpointError(f"{self.path}: {e}") from None
            self.verified.add(ref.blob)
        return ref.t


class _Shards:
    """The chunks of every saved DTensor, by path, across the shard files (each mapped when first needed);
    `region` builds any part of a saved tensor from the chunks that overlap it."""

    def __init__(self, folder: Path, manifest: dict, own: int, own_chunks: dict, own_entries: list):
        self.folder, self.manifest, self.own = folder, manifest, own
        self.files: dict = {own: (own_chunks, own_entries)}  # rank -> ({path: tensor} or _Shard, entries)
        self.chunks: dict | None = None

    def _open(self, r: int):
        if r not in self.files:
            sh = _Shard(self.folder / self.manifest["shards"][r]["file"])
            part = sh.tree.get("shard") if isinstance(sh.tree, dict) else None
            entries = _check_shard_meta({"shard": part}, sh.path, self.manifest, r)
            self.files[r] = (sh, entries)
        return self.files[r]

    def _index(self) -> dict:
        if self.chunks is None:
            self.chunks = {}
            for r in [self.own] + [r for r in range(self.manifest["world_size"]) if r != self.own]:
                _, entries = self._open(r)
                for e in entries:
                    self.chunks.setdefault(tuple(e["path"]), []).append((r, e))
        return self.chunks

    def _shape(self, r: int, e: dict) -> tuple:
        "A saved chunk's shape, from the file's tensor table (its data not read)."
        src, _ = self.files[r]
        if isinstance(src, _Shard):
            ref = _get(src.tree, e["path"], src.path)
            if not isinstance(ref, _Ref):
                raise CheckpointError(f"{src.path}: {'.'.join(map(str, e['path']))}: expected a tensor")
            return tuple(ref.t.shape)
        return tuple(src[tuple(e["path"])].shape)

    def _read(self, r: int, e: dict) -> torch.Tensor:
        src, _ = self.files[r]
        t = src.tensor(e["path"]) if isinstance(src, _Shard) else src[tuple(e["path"])]
        _chunk_fits(e, t, self.folder / self.manifest["shards"][r]["file"])
        return t

    def region(self, path, shape, offset, size) -> torch.Tensor:
        """The part `[offset, offset + size)` of the saved tensor at `path` (global `shape`), in new memory,
        from the chunks that overlap it (this rank's own file first); raise unless they cover it."""
        key = ".".join(map(str, path))
        found = self._index().get(tuple(path), [])
        if not found:
            raise CheckpointError(f"{self.folder}: {key}: no rank saved a part of it")
        for _, e in found:
            if list(e["shape"]) != list(shape):
                raise CheckpointError(f"{self.folder}: {key}: saved with shapes {e['shape']} and {list(shape)}")
        need = 1
        for n in size:
            need *= n
        boxes = set()
        for r, e in found:
            boxes.add((tuple(e["offset"]), self._shape(r, e)))
        held = 0
        for _, shp in boxes:
            vol = 1
            for n in shp:
                vol *= n
            held += vol
        if need > held:  # (checked before anything is allocated: the files' own data bound what a load makes)
            raise CheckpointError(f"{self.folder}: {key}: the saved chunks hold {held} elements, {need} are needed")
        if need == 0:
            return torch.empty(size, dtype=self._read(*found[0]).dtype)
        out, covered, seen = None, 0, set()
        for r, e in found:
            lo = [max(a, b) for a, b in zip(offset, e["offset"])]
            t = self._read(r, e)
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, size, e["offset"], t.shape)]
            box = (tuple(e["offset"]), tuple(t.shape))
            if any(h <= a for a, h in zip(lo, hi)) or box in seen:
                continue  # no overlap, or a replica of a chunk already taken
            seen.add(box)
            src = t[tuple(slice(a - b, c - b) for a, b, c in zip(lo, e["offset"], hi))]
            if out is None:
                if tuple(lo) == tuple(offset) and tuple(src.shape) == tuple(size):
                    return src.clone()  # one chunk covers it
                out = torch.empty(size, dtype=t.dtype)
            out[tuple(slice(a - o, c - o) for a, o, c in zip(lo, offset, hi))] = src
            vol = 1
            for a, c in zip(lo, hi):
                vol *= c - a
            covered += vol
        if out is None or covered != need:
            raise CheckpointError(
                f"{self.folder}: {key}: the saved chunks cover {covered} of the {need} elements at {list(offset)}"
            )
        return out


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
        _set_at(tree, path, _as_dtensor(part, v.shape, like.device_mesh, list(like.placements), like.to_local().device))

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
    return dist.together(
        f"read {path.name}",
        lambda: _read_folder(path, live),
        f"{path}: rank {{rank}} could not read its part: {{why}}",
    )


_NOT_SHARED = (
    " on this rank's disk (where the nodes do not share the folder, each rank's file is on its own node's disk, "
    "and the manifest on rank 0's: a resume needs them together; keep the checkpoints in a folder every node "
    "shares, or use AutoCheckpoint(remote=...))"
)


def _open_folder(path: Path, base_rank: int | None = None):
    """The sharded checkpoint at `path`, checked whole (manifest, every shard file there at its size), and one
    rank's file read (`base_rank`: this rank's, or rank 0's for a rank the saved run did not have):
    (manifest, its tree without its shard part, its DTensor entries, the `_Shards` of all)."""
    m = read_manifest(path)
    for s in m["shards"]:  # every rank checks them all: a checkpoint with a shard missing is invalid for all
        f = path / s["file"]
        if not f.is_file():
            raise CheckpointError(
                f"{path}: rank {s['rank']}'s file {s['file']} is missing: the checkpoint is incomplete"
                + (_NOT_SHARED if dist.active() else "")
            )
        if f.stat().st_size != s["size"]:
            raise CheckpointError(
                f"{path}: rank {s['rank']}'s file {s['file']} has {f.stat().st_size:,} bytes, the manifest "
                f"says {s['size']:,}: the checkpoint is incomplete"
            )
    if base_rank is None:
        base_rank = dist.rank() if dist.rank() < m["world_size"] else 0
    f = path / m["shards"][base_rank]["file"]
    tree = io.load(f)
    entries = _check_shard_meta(tree, f, m, base_rank)
    del tree["shard"]
    checkpoint.check(tree, f)
    own = {}
    for e in entries:
        own[tuple(e["path"])] = t = _get(tree, e["path"], f)
        _chunk_fits(e, t, f)
    return m, tree, entries, _Shards(path, m, base_rank, own, entries)


def _read_folder(path: Path, live: _Live) -> dict:
    _, tree, entries, shards = _open_folder(path)
    for e in entries:
        t = shards.files[shards.own][0][tuple(e["path"])]
        size, offset, mesh, placements, device = live.part(e["path"], e["shape"], path)
        if tuple(offset) == tuple(e["offset"]) and tuple(size) == tuple(t.shape):
            part = t  # this rank's own chunk (the file was read into memory of this process's own)
        else:
            part = shards.region(e["path"], e["shape"], offset, size)
        if mesh is not None:
            part = _as_dtensor(part, e["shape"], mesh, placements, device)
        _set_at(tree, e["path"], part)
    return tree


def gathered(path) -> dict:
    """The sharded checkpoint at `path` as one process's tree: every saved DTensor whole (from every rank's
    chunks), everything else rank 0's (its buffers and training state). For the command-line tool's
    conversions, which hold the whole state in their one process (the training ranks never do)."""
    _, tree, entries, shards = _open_folder(Path(path), 0)
    for e in entries:
        _set_at(tree, e["path"], shards.region(e["path"], e["shape"], (0,) * len(e["shape"]), e["shape"]))
    return tree


# ---- another world size -----------------------------------------------------------------------------


def batches_per_rank(n_iter_all: int, world: int) -> int:
    "Training batches per rank per epoch for a loader of `n_iter_all` batches (fastai's `DistributedDL.__len__`)."
    return -(-n_iter_all // world) if world > 1 else n_iter_all


def continue_at(learn, train: dict, source, n_epoch: int) -> dict:
    """The saved training state of a fit of another world size, as this fit continues it: the position
    counted in samples (the epoch's training samples done across the saved ranks, in whole batches of this
    world size; what does not make a whole batch is trained again). Says plainly that the run is no longer
    the uninterrupted one: every rank's share of the data differs. Raises what cannot be continued."""
    pos = train["position"]
    old, new = pos["world_size"], dist.world()
    bs = pos["bs"]
    if loaders.is_stream(learn.dls.train):
        raise ValueError(
            f"{source} was saved by {old} process(es); this fit runs {new}. Its training data is a stream, whose "
            "position cannot be moved to another number of processes: resume it with "
            f"{old}, or pass start_epoch to start an epoch anew"
        )
    if not bs:
        raise ValueError(f"{source}: its training loader has no batch size: it cannot be continued by {new} processes")
    if train.get("grads") is not None:
        raise ValueError(
            f"{source} was saved by {old} process(es) in the middle of a gradient accumulation; its partial "
            f"gradients (sums over each process's own batches) cannot be continued by {new}: resume it with "
            f"{old}, or from a checkpoint saved at an optimizer step"
        )
    n_iter = batches_per_rank(pos["n_iter_all"], new)
    done = pos["iter"] * bs * old  # training samples of this epoch done, across the saved ranks
    if pos.get("loader_done") or pos["iter"] >= pos["n_iter"]:
        it = n_iter
    else:
        it = min(done // (bs * new), n_iter)
    again = done - it * bs * new if it < n_iter else 0
    epoch = pos["epoch"]
    train_iter = epoch * n_iter + it
    moved = {
        **pos,
        "iter": it,
        "n_iter": n_iter,
        "train_iter": train_iter,
        "pct_train": train_iter / max(1, n_epoch * n_iter),
        "world_size": new,
        "saved_world_size": old,
    }
    msg = (
        f"fastai_resume: {source} was saved by {old} process(es) and this fit runs {new}: it continues at epoch "
        f"{epoch}, iteration {it} of {n_iter} per process (the position counted in samples: {done:,} training "
        "samples of the epoch were done"
        + (f"; {again:,} of them, less than a batch of every process, are trained again" if again else "")
        + f"). The model and optimizer are the saved ones, rebuilt exactly for {new} process(es), but each "
        "process's share of the data differs from the uninterrupted run's: the result is no longer the "
        "uninterrupted run's"
    )
    print(msg, flush=True)
    warnings.warn(msg, stacklevel=3)
    return {**train, "position": moved, "ranks": None}


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
        saves.committed(path, files if dist.rank() == 0 else None)
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
    saves.committed(path, files if dist.rank() == 0 else None)


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


# ---- what the command-line tool shows ---------------------------------------------------------------


def describe(path, verify: bool = True) -> dict:
    """For `fastai-resume inspect` and `verify`: the manifest, and per rank its file's facts (size; what is wrong
    with it, or None) and its chunk of every saved DTensor (path, global shape, offset, local shape); the tree
    of the first rank's file that is well formed (`io.info`'s, its tensors as table entries), or None. Raises
    only if the manifest is unreadable."""
    m = read_manifest(path)
    ranks: list = []
    first = None
    for s in m["shards"]:
        f = Path(path) / s["file"]
        row: dict = {"rank": s["rank"], "file": s["file"], "size": s["size"], "problem": None, "chunks": []}
        ranks.append(row)
        try:
            if not f.is_file():
                raise _Bad("is missing")
            if f.stat().st_size != s["size"]:
                raise _Bad(f"has {f.stat().st_size:,} bytes, the manifest says {s['size']:,}")
            info = io.info(f, verify=False)
            tree = io.stand_ins(info["tree"])
            entries = _check_shard_meta(tree, f, m, s["rank"])
            checkpoint.check({k: v for k, v in tree.items() if k != "shard"}, f)
            if verify:
                io.info(f, verify=True)
        except _Bad as e:
            row["problem"] = str(e)
            continue
        except (CheckpointError, OSError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            row["problem"] = why[len(f"{f}: ") :] if why.startswith(f"{f}: ") else why
            continue
        if first is None:
            first = info["tree"]
        for entry in entries:
            try:
                local = list(_at(info["tree"], entry["path"]).shape)
            except (KeyError, IndexError, TypeError, AttributeError):
                local = None
            row["chunks"].append((".".join(map(str, entry["path"])), entry["shape"], entry["offset"], local))
    return {"manifest": m, "ranks": ranks, "tree": first}
