"""A DataLoader's iteration state as a plain tree, and the skip of a resumed epoch's first k batches.

This is the one place that knows how each kind of loader decides what it yields:

- fastai's `DataLoader` and its subclasses: the shuffling RNG (`dl.rng`) and, for loaders that keep
  their order in their items (`LMDataLoader`'s `ReindexCollection`, shuffled in place every epoch),
  that order. The skip cuts the epoch's index list, so the skipped batches are never loaded.
- PyTorch's `DataLoader`: the order comes from its sampler, drawn from the global torch RNG or the
  loader's / sampler's `generator` (saved). The skip drops the first k index lists of the batch
  sampler (indices only, no data loaded).
- Streams (`DataLoader(indexed=False)`, an `IterableDataset`): `stream_way` decides, with what
  `streams` knows of each library's state: from the state at the save point where it is complete and
  of the object that moved (the loader or its dataset implements `state_dict()` / `load_state_dict()`,
  read in this process, or torchdata's `StatefulDataLoader`), nothing re-read; else a stream known to
  repeat each pass (Hugging Face `datasets`) replays the epoch from its start, reading and discarding
  the trained batches; any other is refused with what to do, unless the user opted in to that
  fast-forward.

With worker processes, a fastai `DataLoader` of a resumable fit seeds the workers' RNGs at every
batch from the epoch's worker seed and the batch's index (`BatchSeeder`), so the random item
transforms of batch j do not depend on which worker made it or on how many batches were skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from . import streams
from .dist import is_distributed_dl, unwrap_dl
from .fastai_classes import is_a
from .fields import a_dict, a_list, a_tensor, need
from .state import check_py_rng

__all__ = [
    "call_hook_first",
    "capture",
    "restore",
    "check_loader",
    "batch_size",
    "is_stream",
    "has_state",
    "skip_first",
    "BatchSeeder",
    "StreamNotResumable",
]


class StreamNotResumable(ValueError):
    "A stream without `state_dict`/`load_state_dict` asked to resume mid-epoch."


def is_fastai(dl) -> bool:
    return is_a(dl, "fastai.data.load", "DataLoader")


def is_torch(dl) -> bool:
    return isinstance(dl, torch.utils.data.DataLoader)


def batch_size(dl) -> int | None:
    dl = unwrap_dl(dl)
    return getattr(dl, "bs", None) if is_fastai(dl) else getattr(dl, "batch_size", None)


def is_stream(dl) -> bool:
    "Does `dl` read an iterator (no index list to cut)?"
    dl = unwrap_dl(dl)
    if is_fastai(dl):
        return not dl.indexed
    return isinstance(getattr(dl, "dataset", None), torch.utils.data.IterableDataset)


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _state_owner(dl):
    "The object whose `state_dict()` describes where `dl` is: the loader itself, or its dataset."
    if _stateful(dl) and not is_fastai(dl):
        return dl
    ds = getattr(dl, "dataset", None)
    return ds if _stateful(ds) else None


def has_state(dl) -> bool:
    return _state_owner(unwrap_dl(dl)) is not None


def _py_rng(s) -> Any:
    return (s[0], tuple(s[1]), s[2])


def _order_list(dl):
    """The list a loader shuffles its items' order in, in place (`LMDataLoader`'s `ReindexCollection`:
    fastcore's `L` or a list, shared with its lengths), or None."""
    idxs = getattr(getattr(dl, "items", None), "idxs", None)
    idxs = getattr(idxs, "items", idxs)  # fastcore's L keeps a list
    return idxs if isinstance(idxs, list) else None


def _order(dl):
    order = _order_list(dl)
    return None if order is None else [int(i) for i in order]


def _generators(dl) -> list:
    "The torch generators that decide a PyTorch loader's order (its own, its samplers')."
    out: list = []
    for owner in (dl, getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not o for o in out):
            out.append(g)
    return out


def capture(dl) -> dict:
    "Everything that decides what `dl` yields next, as a plain tree."
    dl = unwrap_dl(dl)
    st: dict = {"kind": "fastai" if is_fastai(dl) else "torch" if is_torch(dl) else "other"}
    if is_fastai(dl):
        st["rng"] = _py_rng(dl.rng.getstate())
        order = _order(dl)
        if order is not None:
            st["order"] = order
    elif is_torch(dl):
        st["generators"] = [g.get_state() for g in _generators(dl)]
    owner = _state_owner(dl)
    if owner is not None and is_stream(dl):
        st["state"] = streams.storable(owner.state_dict())
    return st


def restore(dl, st: dict, with_stream_state: bool = True) -> None:
    "Put `dl` back where `capture` saw it."
    dl = unwrap_dl(dl)
    if "rng" in st and hasattr(dl, "rng"):
        s = st["rng"]
        dl.rng.setstate((s[0], tuple(s[1]), s[2]))
    if "order" in st and _order_list(dl) is not None:
        _order_list(dl)[:] = st["order"]
        if hasattr(dl, "make_chunks"):
            dl.make_chunks()
    if "generators" in st:
        for g, s in zip(_generators(dl), st["generators"]):
            g.set_state(s.clone())
    if with_stream_state and "state" in st:
        owner = _state_owner(dl)
        if owner is not None:
            owner.load_state_dict(streams.from_storable(st["state"]))


class _SkippedIdxs(list):
    "The index list of a resumed epoch minus the batches already trained; calls a hook when first iterated."

    def __init__(self, items, on_first_iter):
        super().__init__(items)
        self._hook = on_first_iter

    def __iter__(self):
        if self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return super().__iter__()

    def __reduce__(self):
        return (list, (list(self),))  # workers get a plain list


class _HookedIter:
    "An iterable that calls a hook when first iterated."

    def __init__(self, it, hook):
        self.it, self.hook = it, hook

    def __iter__(self):
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return iter(self.it)


class _SkipBatchSampler:
    "A PyTorch batch sampler whose next iteration drops its first k index lists (indices only)."

    def __init__(self, inner, k, on_skipped, put_back):
        self.inner, self.k, self.on_skipped, self.put_back = inner, k, on_skipped, put_back

    def __len__(self):
        return len(self.inner)

    def __iter__(self):  # a generator: like the samplers it wraps, it draws nothing before the first batch
        self.put_back()
        it = iter(self.inner)
        for _ in range(self.k):
            if next(it, None) is None:
                break
        self.on_skipped()
        yield from it


def _dataset(dl):
    return getattr(unwrap_dl(dl), "dataset", None)


def _workers(dl) -> int:
    "The worker processes that read `dl` (fastai's loader keeps the count in its `_FakeLoader`)."
    return getattr(getattr(dl, "fake_l", None) if is_fastai(dl) else dl, "num_workers", 0) or 0


def keeps_position(dl) -> bool:
    "Does a stream's state at an epoch's end say where its next epoch starts (not a stream that restarts each pass)?"
    return not streams.restarts_each_pass(_dataset(dl))


def stream_way(dl, fast_forward: bool = False) -> tuple[str, str]:
    """How a stream resumes mid-epoch, and why not from its state: `state` (its saved state is loaded:
    nothing re-read), `replay` (a stream known to repeat each pass: the epoch is read from its start and
    discarded up to the position), `fast-forward` (the same, vouched for by the user) or `refuse`."""
    dl = unwrap_dl(dl)
    ds, owner = _dataset(dl), _state_owner(dl)
    workers = _workers(dl)
    in_workers = owner is not None and owner is not dl and workers > 0
    if owner is not None and not in_workers and streams.partial_state(ds) is None:
        return "state", ""
    why = streams.partial_state(ds) or (
        f"its position lives in the {workers} worker processes that read it (num_workers={workers}): the copy "
        "this process holds, whose state a checkpoint would take, never moves"
        if in_workers
        else "it has no state_dict()/load_state_dict(), so where it was is unknown"
    )
    if streams.replayable(ds):
        return "replay", why
    return ("fast-forward" if fast_forward else "refuse"), why


def _refusal(dl, why, where, k) -> str:
    ds = _dataset(dl)
    name = type(ds if ds is not None else unwrap_dl(dl)).__name__
    if "worker processes" in why:
        return (
            f"cannot resume {where}mid-epoch exactly: the training DataLoader reads a stream ({name}) and {why}. "
            f"Options: hand fastai torchdata's StatefulDataLoader (it collects each worker's state), or read the "
            "stream with num_workers=0; or load with fast_forward=True (learn.load(..., fast_forward=True) / "
            f"AutoCheckpoint(fast_forward=True)) if every pass of it is the same: its first {k} batches are read "
            "again and discarded; or fit with start_iter=0 to restart the epoch."
        )
    return (
        f"cannot resume {where}mid-epoch exactly: the training DataLoader reads a stream ({name}) that has no "
        f"state_dict()/load_state_dict(), so where it was after {k} batches is unknown. Options: give the dataset "
        "(or use a loader with) state_dict()/load_state_dict() (torchdata's StatefulDataLoader, or your own two "
        "methods), and the resume is exact without re-reading; or load with fast_forward=True "
        "(learn.load(..., fast_forward=True) / AutoCheckpoint(fast_forward=True)) to read and discard the skipped "
        "batches; or fit with start_iter=0 to restart the epoch."
    )


def describe(dl) -> dict:
    "What `fastai-resume check` tells a stream's resume by: its name, worker processes, what its state leaves out."
    u = unwrap_dl(dl)
    if not is_stream(u):
        return {"stream": False}
    ds = _dataset(u)
    return {
        "stream": True,
        "name": type(ds if ds is not None else u).__name__,
        "workers": _workers(u) if _state_owner(u) is not u else 0,  # (a StatefulDataLoader's state holds its workers')
        "partial": streams.partial_state(ds),
    }


def forget_loaded(dl) -> None:
    "Once the resumed epoch's first batch is in: the stream's loaded state applies to no later epoch."
    streams.forget_loaded(_dataset(dl))


def skip_first(dl, k: int, on_skipped, fast_forward: bool = False, where: str = "", whole: bool = False) -> str:
    """Make the next epoch of `dl` start at batch `k`, calling `on_skipped()` once the skipped part is
    behind (when the loader first reads its index list, before the first kept item is made and after the
    loader's own draws at the epoch's start). Returns how the skip is done. A fastai `DistributedDL` is
    cut itself (its index list is this rank's shard), not the loader it wraps. A stream resumes as
    `stream_way` says: from its loaded state (nothing is cut), or `all_batches` reads and discards k
    batches (a replay, or a fast-forward), then calls `on_skipped` itself; or it is refused."""
    cut = k
    how = "index list" if is_fastai(dl) else "batch sampler"
    sized = is_fastai(dl) and unwrap_dl(dl).n is not None  # a fastai stream of a fixed length per epoch (`n=`)
    if is_stream(dl):
        way, why = stream_way(dl, fast_forward)
        if way == "refuse":
            raise StreamNotResumable(_refusal(dl, why, where, k))
        if way != "state" and not (sized and (whole or k >= len(unwrap_dl(dl)))):  # (at its end: nothing to read)
            return f"{way} ({why})" if way == "replay" else way
        # the stream continues from its loaded state: nothing of it is re-read; an epoch of `n` items
        # still has only its remaining batches to run
        cut, how = (k, "stream state, remaining batches") if sized else (0, "stream state")
    if is_fastai(dl):
        get_idxs = dl.get_idxs
        bs = dl.bs or 1

        def skipped_idxs():
            del dl.get_idxs  # one epoch only: back to the class's method
            if is_distributed_dl(dl):
                dl.i = cut * bs  # its count of this rank's items
            idxs = get_idxs()
            if not isinstance(idxs, list):
                if not dl.indexed and dl.n is None:
                    return _HookedIter(idxs, on_skipped)  # a stream of unknown length
                # an epoch's order as an iterator (SortedDL's shuffle_fn returns one): the same order, cut
                idxs = list(idxs)
            # (`whole`: the epoch's data was all read, the partial batch drop_last discards too, before the save)
            return _SkippedIdxs([] if whole else idxs[cut * bs :] if cut else idxs, on_skipped)

        dl.get_idxs = skipped_idxs
        return how
    if is_torch(dl):
        if dl.batch_sampler is None:
            raise ValueError(
                f"cannot resume {where}mid-epoch: this PyTorch DataLoader has no batch sampler "
                "(batch_size=None); fit with start_iter=0 to restart the epoch"
            )
        inner = dl.batch_sampler

        def put_back():
            object.__setattr__(dl, "batch_sampler", inner)

        object.__setattr__(dl, "batch_sampler", _SkipBatchSampler(inner, cut, on_skipped, put_back))
        return how
    raise ValueError(
        f"cannot resume {where}mid-epoch: {type(dl).__name__} is neither a fastai nor a PyTorch "
        "DataLoader; fit with start_iter=0 to restart the epoch"
    )


def call_hook_first(f, hook, put_back):
    """`f`, callable once more with `hook()` run before it (then `put_back(f)`). A fastai `Pipeline`
    stays a `Pipeline` sharing its attributes (the loader's `before_iter` sets its `split_idx`)."""
    if not is_a(f, "fasttransform.transform", "Pipeline") and not is_a(f, "fastcore.transform", "Pipeline"):

        def first(*args, **kwargs):
            put_back(f)
            hook()
            return f(*args, **kwargs)

        return first

    class First(type(f)):
        def __call__(self, *args, **kwargs):
            put_back(f)
            hook()
            return f(*args, **kwargs)

    g = object.__new__(First)
    g.__dict__ = f.__dict__  # one set of attributes for both
    return g


def warm(dls) -> None:
    "Compute what fastai computes lazily with the RNG on first use (TfmdDL's `_one_pass`), before any restore."
    for dl in dls.loaders:
        try:
            getattr(dl, "n_inp", None)
        except Exception:
            pass


def seed_workers(dls) -> None:
    "At a resumable fit's start: fastai loaders with worker processes seed them per batch (`BatchSeeder`)."
    for dl in dls.loaders:
        if is_fastai(dl) and dl.num_workers > 0 and not isinstance(dl.__dict__.get("do_item"), BatchSeeder):
            dl.do_item = BatchSeeder(type(dl).do_item.__get__(dl), dl.bs or 1, 0)


def seed_epoch(dls, first_iter) -> None:
    """Before the training loop (`first_iter`: its first batch) or validation (None): the per-batch seeds
    count from there, for the training loader, and from 0 for the others."""
    for dl in dls.loaders:
        do_item = dl.__dict__.get("do_item") if is_fastai(dl) else None
        if isinstance(do_item, BatchSeeder) and (first_iter is not None or dl is not dls.train):
            do_item.first, do_item.n = (first_iter if dl is dls.train and first_iter is not None else 0), 0


def before_first_batch(dl, hook) -> None:
    """With worker processes the skipped part is behind the main process once the loader hands over its
    first batch: `hook()` (the saved RNG back) before that batch's `after_batch` transforms run."""
    if is_fastai(dl):
        dl.after_batch = call_hook_first(dl.after_batch, hook, lambda orig: setattr(dl, "after_batch", orig))


class BatchSeeder:
    """`do_item` of a fastai DataLoader in worker processes: before the first item of each batch, seed
    Python's, NumPy's and torch's RNG from the epoch's worker seed and the batch's index in the epoch,
    so what a random item transform draws for batch j does not depend on the worker or on a skip."""

    def __init__(self, do_item, bs: int, first: int):
        self.do_item, self.bs, self.first, self.n = do_item, bs, first, 0

    def __call__(self, s):
        info = torch.utils.data.get_worker_info()
        if info is not None and self.n % self.bs == 0:
            d = info.dataset.d  # fastai's _FakeLoader: its DataLoader knows its worker offset
            j = self.first + d.offs + (self.n // self.bs) * d.num_workers
            base = info.seed - info.id
            from fastai.torch_core import set_seed

            set_seed((base * 0x9E3779B1 + j * 0x85EBCA77 + 0x165667B1) % (1 << 32))
        self.n += 1
        return self.do_item(s)


# ---- what a file's copy of a loader's state must be (`pieces` checks it before anything is restored) -------


def check_loader(v, where) -> None:
    "One DataLoader's iteration state (`loaders.capture`)."
    v = a_dict(v, where, ("kind",))
    need(v["kind"] in ("fastai", "torch", "other"), where, f"unknown loader kind {v['kind']!r:.20}")
    if "rng" in v:
        check_py_rng(v["rng"], f"{where}.rng")
    if "order" in v:
        order = a_list(v["order"], f"{where}.order")
        need(
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(order) for i in order)
            and len(set(order)) == len(order),
            f"{where}.order",
            "not a permutation",
        )
    for i, g in enumerate(a_list(v.get("generators", []), f"{where}.generators")):
        a_tensor(g, f"{where}.generators[{i}]", torch.uint8, 1)
