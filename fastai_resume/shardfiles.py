"""A sharded checkpoint's files, read without a model: the manifest and each rank's file, validated
(`read_manifest`, `open_folder`); any part of a saved tensor put together from the chunks that overlap it
(`Shards.region`: shard files mapped, each blob verified when first read); the whole state in one process
(`gathered`, for the command-line tool's conversions); what is wrong with a folder (`problem`, `verify`,
`describe`). `sharded` writes these files and reads them into a live (sharded) model.

    shard-<rank>-of-<world>-<token>.frk   a rank's file (`shard_name`), its DTensors' local tensors and their
                                          placement in its `shard` part
    manifest.frk                          committed last: the save's token, world size, every file's size
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from . import checkpoint, dist, io
from .fields import Bad, is_int, need, refused
from .io import CheckpointError
from .paths import MANIFEST

__all__ = [
    "SCHEMA",
    "SHARD_FILE",
    "shard_name",
    "read_manifest",
    "open_folder",
    "gathered",
    "set_at",
    "problem",
    "verify",
    "describe",
]

SCHEMA = 1  # the manifest's own version (its key `fastai_resume_sharded`)
SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})-([0-9a-f]{16})\.frk$")


MISSING = "is missing"  # what is wrong with a rank's file this disk lacks (`problems`, `verify`'s `Incomplete`)


def shard_name(rank: int, world: int, token: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}-{token:016x}.frk"


# ---- the manifest and each rank's file --------------------------------------------------------------


def read_manifest(path, mf: Path | None = None) -> dict:
    "The manifest of the sharded checkpoint `path` (or the file `mf`), validated (its shard files are not opened)."
    p = Path(path)
    mf = p / MANIFEST if mf is None else mf
    if not mf.is_file():
        raise CheckpointError(
            f"{p}: no {MANIFEST}: not a sharded checkpoint, or a save that did not finish (every rank's "
            "file is committed first, the manifest last)" + (NOT_SHARED if dist.active() else "")
        )
    m = io.load(mf)
    with refused(f"{mf}: malformed manifest: "):
        need(
            isinstance(m, dict) and is_int(m.get("fastai_resume_sharded"), 1), "", "not a sharded checkpoint's manifest"
        )
        need(
            m["fastai_resume_sharded"] <= SCHEMA,
            "",
            f"written by a newer fastai_resume (manifest schema {m['fastai_resume_sharded']}): upgrade to read it",
        )
        n, token = m.get("world_size"), m.get("token")
        need(is_int(n, 1) and n < 100000, "world_size", "expected an int >= 1")
        need(is_int(token, 1), "token", "expected an int")
        shards = m.get("shards")
        need(isinstance(shards, list) and len(shards) == n, "shards", f"expected a list of {n}")
        for r, s in enumerate(shards):
            need(
                isinstance(s, dict)
                and s.get("rank") == r
                and s.get("file") == shard_name(r, n, token)
                and is_int(s.get("size")),
                f"shards[{r}]",
                f"expected rank {r}, file {shard_name(r, n, token)} and its size",
            )
        need(m.get("position") is None or isinstance(m["position"], dict), "position", "expected a dict or None")
    return m


def _check_shard_meta(tree, path, manifest, rank) -> list:
    "Raise unless the rank file `path` belongs to this manifest as rank `rank`; its DTensor entries."
    with refused(f"{path}: "):
        need(isinstance(tree, dict) and isinstance(tree.get("shard"), dict), "", "no 'shard' part: not a rank's file")
        sh = tree["shard"]
        need(
            sh.get("rank") == rank
            and sh.get("world_size") == manifest["world_size"]
            and sh.get("token") == manifest["token"],
            "",
            f"written as rank {sh.get('rank')} of {sh.get('world_size')} by save {sh.get('token')!r}, "
            f"the manifest wants rank {rank} of {manifest['world_size']} of save {manifest['token']}",
        )
        entries = sh.get("dtensors")
        need(isinstance(entries, list), "shard.dtensors", "expected a list")
        for i, e in enumerate(entries):
            at = f"shard.dtensors[{i}]"
            need(isinstance(e, dict), at, "expected a dict")
            pth, shp, off, pl, mesh = (e.get(k) for k in ("path", "shape", "offset", "placements", "mesh"))
            need(
                isinstance(pth, list) and pth and all(isinstance(k, (str, int)) for k in pth),
                f"{at}.path",
                "expected a list of keys",
            )
            need(isinstance(shp, list) and all(is_int(x) for x in shp), f"{at}.shape", "expected ints")
            need(
                isinstance(off, list) and len(off) == len(shp) and all(is_int(x) for x in off),
                f"{at}.offset",
                f"expected {len(shp)} ints",
            )
            need(isinstance(mesh, list) and mesh and all(is_int(x, 1) for x in mesh), f"{at}.mesh", "expected ints")
            need(
                isinstance(pl, list)
                and len(pl) == len(mesh)
                and all(
                    p == ["replicate"] or (isinstance(p, list) and len(p) == 2 and p[0] == "shard" and is_int(p[1]))
                    for p in pl
                ),
                f"{at}.placements",
                "expected ['shard', dim] or ['replicate'] per mesh dimension",
            )
    return entries


def _at(tree, path):
    v = tree
    for k in path:
        v = v[k]
    return v


def set_at(tree, path, value):
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
    "Raise `CheckpointError` (`Incomplete`: a rank's file is missing) unless the sharded checkpoint `path` verifies."
    p = Path(path)
    why = problem(p, verify=True)
    if why is not None:
        raise (Incomplete if why.endswith(f" {MISSING}") else CheckpointError)(
            why if why.startswith(str(p)) else f"{p}: {why}"
        )


class Incomplete(CheckpointError):
    """A sharded checkpoint whose manifest names a rank's file this disk lacks: under torch.distributed, a
    folder that is not shared by the nodes (each rank's file is on its own node's disk), not a corrupt one."""


NOT_SHARED = (
    " on this rank's disk (where the nodes do not share the folder, each rank's file is on its own node's disk "
    "and the manifest on rank 0's, and a resume needs them together: keep a sharded fit's checkpoints in a "
    "folder every node shares)"
)


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
        self.file = io.Mapped(path)
        self.tree = self.file.tree(_Ref)
        self.verified: set = set()

    def tensor(self, path: list) -> torch.Tensor:
        ref = _get(self.tree, path, self.path)
        if not isinstance(ref, _Ref):
            raise CheckpointError(f"{self.path}: {'.'.join(map(str, path))}: expected a tensor")
        if ref.blob not in self.verified:
            self.file.verify_blob(ref.blob)
            self.verified.add(ref.blob)
        return ref.t


class Shards:
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


def open_folder(path: Path, base_rank: int | None = None, manifest: Path | None = None):
    """The sharded checkpoint at `path`, checked whole (manifest, every shard file there at its size), and one
    rank's file read (`base_rank`: this rank's, or rank 0's for a rank the saved run did not have):
    (manifest, its tree without its shard part, its DTensor entries, the `Shards` of all). `manifest`: read
    from there (a copy of rank 0's, on a node whose disk lacks it). Under torch.distributed, at the saved
    world size, each rank checks its own file (every rank reads together: one rank's missing file is an
    error on all)."""
    m = read_manifest(path, manifest)
    only = dist.rank() if dist.active() and dist.world() == m["world_size"] else None
    for s in m["shards"]:  # every rank checks them all: a checkpoint with a shard missing is invalid for all
        if only is not None and s["rank"] != only:
            continue
        f = path / s["file"]
        if not f.is_file():
            raise CheckpointError(
                f"{path}: rank {s['rank']}'s file {s['file']} {MISSING}: the checkpoint is incomplete"
                + (NOT_SHARED if dist.active() else "")
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
    return m, tree, entries, Shards(path, m, base_rank, own, entries)


def gathered(path) -> dict:
    """The sharded checkpoint at `path` as one process's tree: every saved DTensor whole (from every rank's
    chunks), everything else rank 0's (its buffers and training state). For the command-line tool's
    conversions, which hold the whole state in their one process (the training ranks never do)."""
    _, tree, entries, shards = open_folder(Path(path), 0)
    for e in entries:
        set_at(tree, e["path"], shards.region(e["path"], e["shape"], (0,) * len(e["shape"]), e["shape"]))
    return tree


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
        row, info, entries = _file_row(Path(path), m, s, verify)
        ranks.append(row)
        if row["problem"] is not None:
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


def _file_row(path: Path, m: dict, s: dict, verify: bool):
    "One rank's file of the manifest `m`: ({rank, file, size, problem (None: well formed), chunks}, info, entries)."
    f = path / s["file"]
    row: dict = {"rank": s["rank"], "file": s["file"], "size": s["size"], "problem": None, "chunks": []}
    try:
        if not f.is_file():
            raise Bad(MISSING)
        if f.stat().st_size != s["size"]:
            raise Bad(f"has {f.stat().st_size:,} bytes, the manifest says {s['size']:,}")
        info = io.info(f, verify=False)
        tree = io.stand_ins(info["tree"])
        entries = _check_shard_meta(tree, f, m, s["rank"])
        checkpoint.check({k: v for k, v in tree.items() if k != "shard"}, f)
        if verify:
            io.info(f, verify=True)
    except Bad as e:
        row["problem"] = str(e)
        return row, None, []
    except (CheckpointError, OSError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        row["problem"] = why[len(f"{f}: ") :] if why.startswith(f"{f}: ") else why
        return row, None, []
    return row, info, entries


def problems(path, ranks, manifest: Path) -> list:
    """What is wrong with the files of `ranks` of the sharded checkpoint `path`, its manifest read from
    `manifest` (a copy of rank 0's where this disk lacks it): [(rank, file, problem)] of the files that are
    missing (`MISSING`), the wrong size, malformed or fail a checksum; [] where they all verify. Each rank of
    a resume checks its own on node-local disks (`RunFolder.latest_valid_together`)."""
    m = read_manifest(path, manifest)
    out = []
    for s in m["shards"]:
        if s["rank"] in ranks:
            row, _, _ = _file_row(Path(path), m, s, verify=True)
            if row["problem"] is not None:
                out.append((row["rank"], row["file"], row["problem"]))
    return out
