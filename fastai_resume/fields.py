"""The validation kit: checks of a value read from an untrusted place (a checkpoint's training state, a
sharded checkpoint's manifest, a remote marker) that name the field they refuse, e.g.
`train.position.epoch: expected an int >= 0, got '1'`.

A check raises `Bad` with the field's path and what is wrong; the caller turns the first one into the
`CheckpointError` its users read, with `refused(prefix)`, so a file is judged whole before anything of it is
used and the error says which field to look at.
"""

from __future__ import annotations

import contextlib

import torch

from .io import CheckpointError

__all__ = ["Bad", "need", "refused", "is_int", "an_int", "a_number", "a_dict", "a_list", "a_tensor"]


class Bad(Exception):
    "A malformed field: its path and what is wrong with it (`need`)."


def need(ok, where: str, what: str) -> None:
    "Raise `Bad` naming the field `where` (a path; '' for the whole value) unless `ok`."
    if not ok:
        raise Bad(f"{where}: {what}" if where else what)


@contextlib.contextmanager
def refused(prefix: str):
    "The first `Bad` raised inside, as the `CheckpointError` users read: `prefix` and the field's path."
    try:
        yield
    except Bad as e:
        raise CheckpointError(f"{prefix}{e}") from None


def is_int(v, lo: int = 0) -> bool:
    "An int (bool is not one: a file's `true` is no count) of at least `lo`."
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def an_int(v, where: str, lo: int = 0) -> int:
    need(is_int(v, lo), where, f"expected an int >= {lo}, got {v!r:.40}")
    return v


def a_number(v, where: str) -> None:
    need(isinstance(v, (int, float)) and not isinstance(v, bool), where, f"expected a number, got {type(v).__name__}")


def a_dict(v, where: str, keys=()) -> dict:
    "`v` as a dict holding each of `keys`."
    need(isinstance(v, dict), where, f"expected a dict, got {type(v).__name__}")
    for k in keys:
        need(k in v, where, f"missing {k!r}")
    return v


def a_list(v, where: str):
    need(isinstance(v, (list, tuple)), where, f"expected a list, got {type(v).__name__}")
    return v


def a_tensor(v, where: str, dtype=None, dim=None) -> None:
    need(isinstance(v, torch.Tensor), where, f"expected a tensor, got {type(v).__name__}")
    if dtype is not None:
        need(v.dtype == dtype, where, f"dtype {v.dtype}, expected {dtype}")
    if dim is not None:
        need(v.dim() == dim, where, f"{v.dim()} dimensions, expected {dim}")
