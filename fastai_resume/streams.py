"""What a stream's own state is worth, library by library: the one place that knows the stream libraries.

A stream (an `IterableDataset`) says where it is through the ecosystem's `state_dict()` /
`load_state_dict()`. That protocol is evidence, not proof: tests/test_streams.py runs each library as
users call it, and what it found is written here.

- Hugging Face `datasets` (`load_dataset(..., streaming=True)`, `.map`, `.filter`, `.shuffle`,
  `interleave_datasets`, `split_dataset_by_node`): a pass is a deterministic function of the dataset
  and its epoch (`set_epoch`); every `__iter__` starts a new pass. Its state holds the position of each
  source but not the content of a shuffle buffer (`.shuffle(buffer_size=...)`: a loaded state refills the
  buffer with other rows and restarts its RNG), and a loaded state applies to every later `__iter__` of
  the same epoch number, not only to the next one. So: its state is used where it is complete and read
  in this process, and forgotten once the resumed epoch has started; elsewhere the resumed epoch is
  replayed from its start (read and discarded, nothing trained).
- torchdata's `StatefulDataLoader`: its state holds each worker's dataset state, so workers are no
  obstacle; what its dataset's state leaves out, it leaves out too.
- Any other stream with `state_dict()`: trusted when it is read in this process (the state is of the
  object that moved); read by worker processes, the state this process holds never moved, and the
  resume is refused unless the user vouches that a pass can be replayed (`fast_forward=True`).
"""

from __future__ import annotations

__all__ = ["is_hf", "replayable", "partial_state", "forget_loaded", "restarts_each_pass", "storable", "from_storable"]

_BIG = "fastai_resume.int"  # the key of an int wider than 64 bits in a stored state (a NumPy bit generator's)


def storable(v):
    "A stream's state as the format stores it: an int wider than 64 bits as its decimal text, tagged."
    if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < (1 << 63):
        return {_BIG: str(v)}
    if isinstance(v, dict):
        return {k: storable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(storable(x) for x in v)
    return v


def from_storable(v):
    "The state `storable` stored, as the stream gave it."
    if isinstance(v, dict):
        if len(v) == 1 and _BIG in v and isinstance(v[_BIG], str) and v[_BIG].lstrip("-").isdigit():
            return int(v[_BIG])
        return {k: from_storable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(from_storable(x) for x in v)
    return v


def is_hf(ds) -> bool:
    "A Hugging Face `datasets.IterableDataset` (told without importing `datasets`)."
    return any(
        c.__name__ == "IterableDataset" and c.__module__.startswith("datasets.") for c in type(ds).__mro__
    ) and hasattr(ds, "_ex_iterable")


def _ex_iterables(ex, depth=0):
    "An HF stream's tree of example iterables (`.map` wraps one, `interleave_datasets` several)."
    if ex is None or depth > 64:
        return
    yield ex
    yield from _ex_iterables(getattr(ex, "ex_iterable", None), depth + 1)
    for sub in getattr(ex, "ex_iterables", None) or ():
        yield from _ex_iterables(sub, depth + 1)


def partial_state(ds) -> str | None:
    "What `ds.state_dict()` leaves out of its position, or None when it holds all of it (as far as known)."
    if is_hf(ds):
        for ex in _ex_iterables(ds._ex_iterable):
            if type(ex).__name__ == "BufferShuffledExamplesIterable":
                return f"its state holds no content of its shuffle buffer (.shuffle(buffer_size={ex.buffer_size}))"
    return None


def replayable(ds) -> bool:
    "Is every pass of `ds` (each `__iter__`) a deterministic function of what the script set (proven)?"
    return is_hf(ds)


def restarts_each_pass(ds) -> bool:
    "Does each `__iter__` start a new pass whatever state was last saved (its end-of-pass state is no position)?"
    return is_hf(ds)


def forget_loaded(ds) -> None:
    """Once the resumed epoch's iterator has started: a loaded state no longer applies (an HF stream
    would otherwise start every later pass of the same epoch number at the checkpoint's position)."""
    if is_hf(ds) and getattr(ds, "_starting_state_dict", None) is not None:
        ds._starting_state_dict = None
