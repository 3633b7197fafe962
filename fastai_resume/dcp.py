"""torch.distributed.checkpoint (DCP) as an import and export format, never as the storage format: DCP
keeps its metadata in a pickle and its values without checksums. `fastai-resume convert` uses these.

- `export(tree, folder)`: a checkpoint's model and optimizer state (whole tensors) as a DCP checkpoint, written
  by DCP itself (`dcp.save(..., no_dist=True)`), keys `model.<name>` and `opt.<...>` as DCP flattens them. torch's
  `dcp.load` reads it into a model of any sharding (`set_model_state_dict` and friends).
- `read(folder)`: a DCP checkpoint's values as a plain tree (whole tensors, each assembled from its chunks),
  without running code from the files: the `.metadata` pickle is read by an unpickler that builds only DCP's
  own metadata classes, torch dtypes and sizes; each value is read with `torch.load(weights_only=True)`.

Both hold the whole state in the one process that converts (the training ranks never do).
"""

from __future__ import annotations

import io as _io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from .io import CheckpointError

__all__ = ["is_dcp", "export", "read"]

METADATA = ".metadata"


def is_dcp(path) -> bool:
    "A folder holding a DCP checkpoint (its `.metadata` file)."
    p = Path(path)
    return p.is_dir() and (p / METADATA).is_file()


def export(tree: dict, folder) -> None:
    """Write `tree` (`{'model': ..., 'opt': ...}`, whole tensors) as a DCP checkpoint into the new folder
    `folder`. Its containers' kinds go along as one JSON string (`fastai_resume.skeleton`): DCP's flattening
    drops empty dicts and turns int dict keys into strings, which an optimizer's state needs back as they were."""
    import torch.distributed.checkpoint as dcp

    out = {**tree, SKELETON[0]: {SKELETON[1]: json.dumps(_skeleton(tree))}}
    with warnings.catch_warnings():  # (that it saves in one process, without torch.distributed: it does)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(out, storage_writer=dcp.FileSystemWriter(os.fspath(folder)), no_dist=True)


SKELETON = ("fastai_resume", "skeleton")


def _skeleton(v):
    "A tree's containers, without values: {'d': [[key, child], ...]} or {'l': [child, ...]}; a value is null."
    if isinstance(v, dict):
        return {"d": [[k, _skeleton(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple, torch.Tensor)) for x in v):
        return {"l": [_skeleton(x) for x in v]}  # (a list of plain values is one value to DCP)
    return None


def _rebuild(skel, flat: dict, path: tuple, where):
    "The tree `skel` describes, each value taken from `flat` by its DCP path (list index: int; dict key: str)."
    if skel is None:
        if path not in flat:
            raise CheckpointError(f"{where}: {'.'.join(map(str, path))} is not in the checkpoint")
        return flat[path]
    if not isinstance(skel, dict) or not (set(skel) == {"d"} or set(skel) == {"l"}):
        raise CheckpointError(f"{where}: a malformed {SKELETON[0]}.{SKELETON[1]}")
    if "l" in skel:
        return [_rebuild(c, flat, (*path, i), where) for i, c in enumerate(skel["l"])]
    out = {}
    for pair in skel["d"]:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
            raise CheckpointError(f"{where}: a malformed {SKELETON[0]}.{SKELETON[1]}")
        out[pair[0]] = _rebuild(pair[1], flat, (*path, str(pair[0])), where)
    return out


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    "DCP's metadata classes, torch dtypes and sizes; any other global in the file is refused."

    def find_class(self, module, name):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"{METADATA} names {module}.{name}, which a DCP checkpoint's metadata does not hold")


def _metadata(folder: Path):
    try:
        with open(folder / METADATA, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    except Exception as e:  # a damaged pickle: whatever the unpickler meets
        raise CheckpointError(
            f"{folder / METADATA}: not a DCP checkpoint's metadata ({type(e).__name__}: {e})"
        ) from None


def _value(folder: Path, info) -> Any:
    "One stored value (a tensor or a chunk of one, or a plain value) from its file, by `torch.load(weights_only=True)`."
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{folder}: values stored with transforms {info.transform_descriptors} are not read")
    path = folder / info.relative_path
    if os.path.dirname(info.relative_path) or not path.is_file():
        raise CheckpointError(f"{folder}: {info.relative_path!r} is not a file of this checkpoint")
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"{path}: cut short ({len(data)} of {info.length} bytes at {info.offset})")
    try:
        return torch.load(_io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: a value at {info.offset} cannot be read safely ({e})") from None


def read(folder) -> dict:
    "A DCP checkpoint's values as a plain tree (see the module's doc)."
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    folder = Path(folder)
    meta = _metadata(folder)
    storage = getattr(meta, "storage_data", None) or {}
    flat: dict = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            info = storage.get(MetadataIndex(fqn))
            if info is None:
                raise CheckpointError(f"{folder}: {fqn}: no stored value")
            flat[fqn] = _value(folder, info)
        elif isinstance(md, TensorStorageMetadata):
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for ch in md.chunks:
                info = storage.get(MetadataIndex(fqn, ch.offsets))
                if info is None:
                    raise CheckpointError(f"{folder}: {fqn}: no stored chunk at {list(ch.offsets)}")
                t = _value(folder, info)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ch.sizes):
                    raise CheckpointError(f"{folder}: {fqn}: a chunk of {list(ch.sizes)} holds something else")
                box = tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes))
                if any(s.stop > n for s, n in zip(box, md.size)):
                    raise CheckpointError(f"{folder}: {fqn}: a chunk outside {list(md.size)}")
                out[box] = t
            flat[fqn] = out
    paths = getattr(meta, "planner_data", None) or {}
    by_path = {tuple(paths.get(fqn, (fqn,))): v for fqn, v in flat.items()}
    skel = by_path.pop(SKELETON, None)
    if isinstance(skel, str):  # written by `export`: the containers as they were
        try:
            tree = _rebuild(json.loads(skel), by_path, (), folder)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{folder}: a malformed {SKELETON[0]}.{SKELETON[1]} ({e})") from None
        return tree
    return _unflatten(by_path)


def _unflatten(by_path: dict) -> dict:
    "A DCP checkpoint from elsewhere: its flat values back into a tree (int path keys were list indices)."
    root: dict = {}
    for path, v in by_path.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v

    def lists(v):
        if isinstance(v, dict):
            v = {k: lists(x) for k, x in v.items()}
            if v and all(isinstance(k, int) for k in v) and sorted(v) == list(range(len(v))):
                return [v[i] for i in range(len(v))]
        return v

    return lists(root)
