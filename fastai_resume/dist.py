"""torch.distributed plumbing for resumable data-parallel training (fastai's `distrib_ctx`,
Hugging Face Accelerate, launched by `torchrun` or `accelerate launch`), on one machine or several.

Rules: every rank calls `save(with_iter=True)` (as fastai's callbacks do); the ranks' own state
(RNG, DataLoader shuffling state, Recorder) is gathered to rank 0, which alone writes the one
checkpoint file, atomically; every rank returns once the file is committed, or raises with the
others. A decision that could differ between ranks (a time-based checkpoint, a SIGTERM seen by one
rank first, a failed background save) is agreed, so that every rank saves, or stops, at the same batch.

Every collective this package makes is a named *step* (`exchange`, and `verdict`, `together`,
`agree_any`, `all_gather_ints`, `broadcast`, `gather`, `share_file` built on it), and no step waits forever: each
rank posts its value under the step's sequence number in the process group's key-value store (the
one torchrun's agent or `init_process_group` made) and waits for every other rank's, at most
`timeout()` seconds (`FASTAI_RESUME_TIMEOUT`, default 600; `set_timeout`). A rank that does not
arrive (crashed, hung, or running other code: a script that loads a checkpoint on some ranks only)
makes every rank that waits raise `StepTimeout` naming the step and the ranks missing; ranks that
arrive at different steps (code that differs between ranks) raise at once, naming both. Payloads
bigger than a few integers (the ranks' training state, a checkpoint served to ranks whose disk lacks
it) go over a gloo group of the package's own with the same bound, once every rank has arrived.

A model sharded with FSDP2 (`sharded`: its parameters are DTensors) is saved the other way: every
rank writes its own file and a manifest is committed last (`fastai_resume.sharded`); the ranks agree
on the outcome with `all_gather_ints`, a few integers each.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import tempfile
import weakref
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as D

from .fastai_classes import is_a
from .io import CheckpointError

__all__ = [
    "active",
    "rank",
    "world",
    "StepTimeout",
    "timeout",
    "set_timeout",
    "exchange",
    "verdict",
    "RankFailures",
    "together",
    "gather",
    "broadcast",
    "agree_any",
    "all_gather_ints",
    "share_file",
    "fetch_missing",
    "sees_rank0",
    "sharded",
    "is_dtensor",
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


class StepTimeout(CheckpointError):
    "A step of this package's that some rank did not reach within `timeout()` seconds (or reached as another step)."


_TIMEOUT = [float(os.environ.get("FASTAI_RESUME_TIMEOUT", "600"))]


def timeout() -> float:
    "How long (seconds) a rank waits for the others at a step of this package's before every rank raises."
    return _TIMEOUT[0]


def set_timeout(seconds: float) -> None:
    "Wait at most `seconds` at each step (also `FASTAI_RESUME_TIMEOUT`); set it on every rank, before the fit."
    if not seconds > 0:
        raise ValueError(f"set_timeout: {seconds!r} is not a positive number of seconds")
    _TIMEOUT[0] = float(seconds)


class _Steps:
    """The steps of one process group: their count (the same on every rank: each rank makes the same
    steps in the same order), the store their values are posted in, and the gloo group for payloads."""

    generation = 0  # process groups this process has initialised (a script may open distrib_ctx twice)

    def __init__(self, world_group):
        _Steps.generation += 1
        # a weak reference: the group kept past `destroy_process_group` can abort the exit (`_forget`); an id
        # could be the next group's
        self.world, self.seq, self.group = weakref.ref(world_group), 0, None
        # torchrun's agent keeps one store across restarts of the workers: a restart's keys are its own
        self.prefix = f"fastai_resume/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_Steps.generation}"

    @property
    def store(self):
        """The process group's store (asked each time: a reference kept past `destroy_process_group` makes the
        interpreter's exit abort), or None where this torch does not give it (the gloo group's own timeout)."""
        try:
            return D.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None

    def key(self, seq: int, r: int) -> str:
        return f"{self.prefix}/{seq}/{r}"

    def payload_group(self):
        "The gloo group payloads go over (made once, right after a step every rank arrived at)."
        if self.group is None:
            self.group = D.new_group(backend="gloo", timeout=timedelta(seconds=timeout()))
        return self.group


_state: dict = {}


def _steps() -> _Steps:
    world_group = D.group.WORLD
    s = _state.get("steps")
    if s is None or s.world() is not world_group:
        s = _state["steps"] = _Steps(world_group)
    return s


@atexit.register
def _forget() -> None:
    "A process group (the payloads' gloo group) still referenced at the interpreter's end can abort the exit."
    _state.clear()


def exchange(step: str, value=None) -> list:
    """Every rank's `value` (a small JSON-able object: numbers, strings, lists, None) at the step named
    `step`, in rank order; `[value]` outside a process group. Every rank must make the same steps in the
    same order. Raises `StepTimeout` on every rank that waited when a rank has not arrived within
    `timeout()` seconds, and at once when a rank arrived at another step."""
    if not active():
        return [value]
    s, me, n = _steps(), D.get_rank(), D.get_world_size()
    seq = s.seq
    s.seq += 1
    store = s.store
    if store is None:
        return _exchange_over_gloo(s, step, value)
    keys = [s.key(seq, r) for r in range(n)]
    try:
        store.set(keys[me], json.dumps([step, value]))
        store.wait(keys, timedelta(seconds=timeout()))
        rows = [json.loads(v) for v in store.multi_get(keys)]
    except RuntimeError as e:  # the wait timed out, or the store is gone (its host's process died)
        raise StepTimeout(_not_arrived(store, step, keys, e)) from None
    if seq >= 2:  # every rank has read step seq-2 (it has arrived here, past seq-1): this rank's key goes
        store.delete_key(s.key(seq - 2, me))
    steps = [r[0] for r in rows]
    if any(x != step for x in steps):
        raise StepTimeout(
            "fastai_resume: the ranks are at different steps: "
            + ", ".join(f"rank {r} at {x!r}" for r, x in enumerate(steps))
            + ". The script runs different code on different ranks (a load or a fit on some ranks only?): "
            "every rank must make the same training calls in the same order"
        )
    return [r[1] for r in rows]


def _not_arrived(store, step: str, keys: list, e: Exception) -> str:
    "What to say when a step's wait ended without every rank: the ranks that did not arrive, if the store can tell."
    try:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
    except RuntimeError:
        missing = None
    who = f"rank(s) {missing}" if missing else "some rank(s)"
    return (
        f"fastai_resume: step {step!r}: {who} of {len(keys)} did not arrive within {timeout():.0f} s "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). A rank crashed, hangs, or runs other "
        "code (a load or a fit on some ranks only); every rank that waited stops here. FASTAI_RESUME_TIMEOUT "
        "(seconds) or fastai_resume.dist.set_timeout waits longer."
    )


def _exchange_over_gloo(s: _Steps, step: str, value) -> list:
    "`exchange` without a store (a torch that hides it): the gloo group's own bound, the missing ranks unnamed."
    out: list = [None] * D.get_world_size()
    try:
        D.all_gather_object(out, [step, value], group=s.payload_group())
    except RuntimeError as e:
        raise StepTimeout(f"fastai_resume: step {step!r}: not every rank arrived in {timeout():.0f} s ({e})") from None
    if any(r[0] != step for r in out):
        raise StepTimeout(f"fastai_resume: the ranks are at different steps: {[r[0] for r in out]}")
    return [r[1] for r in out]


class RankFailures(CheckpointError):
    "Some ranks failed at one step (`verdict`): `failures`, {rank: what it said}; the message names every one."

    def __init__(self, msg: str, failures: dict):
        super().__init__(msg)
        self.failures = failures

    def __reduce__(self):
        return type(self), (str(self), self.failures)


def verdict(
    step: str,
    failure: Any = None,
    payload=None,
    own: BaseException | None = None,
    failed: str = "{step}: {failures}; every rank stops",
) -> list:
    """The one cross-rank verdict: every rank's `payload`, in rank order, when no rank's `failure` is set;
    otherwise every rank raises, as one step: a rank with `own` (its exception) raises it, with a note naming
    the other ranks that failed, the others one `RankFailures` saying `failed` (formatted with `step` and
    `failures`: every failing rank and why, "rank 0: ...; rank 2: ..."). A failure is a string, or any small
    JSON-able value a caller reads back from `RankFailures.failures`. Outside a process group: `[payload]`,
    or `own`, or the failure as a `RankFailures`."""
    if not active():
        if own is not None:
            raise own
        if failure is not None:
            raise RankFailures(str(failure), {0: failure})
        return [payload]
    rows = exchange(step, [failure, payload])
    bad = {r: row[0] for r, row in enumerate(rows) if row[0] is not None}
    if not bad:
        return [row[1] for row in rows]
    if own is not None:
        others = {r: w for r, w in bad.items() if r != rank()}
        same = [r for r, w in others.items() if w == failure]
        if same:
            own.add_note(f"the same on {_ranks(same)}")
        if len(same) < len(others):
            own.add_note("also failed: " + _named({r: w for r, w in others.items() if w != failure}))
        raise own
    raise RankFailures(failed.format(step=step, failures=_named(bad)), bad)


def _ranks(rs: list) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _named(bad: dict) -> str:
    "Every failing rank and what it said, ranks that said the same together: 'rank 0: ...; ranks 1, 3: ...'."
    said: dict = {}
    for r, why in bad.items():
        said.setdefault(str(why), []).append(r)
    return "; ".join(f"{_ranks(rs)}: {why}" for why, rs in said.items())


def together(step: str, fn, failed: str = "{step}: {failures}; every rank stops"):
    """`fn()` on every rank, as one step (`verdict`): every rank returns its own result, or every rank raises:
    a rank that failed its own exception, the others a `CheckpointError` saying `failed` (formatted with
    `step` and `failures`, every rank that failed and why). Where a failure must stop every rank (a save, a
    load, a check) instead of leaving the others waiting at their next collective."""
    err, out = None, None
    try:
        out = fn()
    except Exception as e:
        if not active():
            raise
        err = e
    verdict(step, None if err is None else f"{type(err).__name__}: {err}", own=err, failed=failed)
    return out


def _arrive_then(step: str, op):
    "Every rank at `step` (bounded), then `op(group)`: a gloo collective that cannot wait for an absent rank."
    exchange(step)
    g = _steps().payload_group()
    try:
        return op(g)
    except RuntimeError as e:  # a rank died in the middle of it
        raise StepTimeout(f"fastai_resume: step {step!r} failed while the ranks exchanged its data: {e}") from None


def gather(step: str, obj) -> list | None:
    "Every rank's `obj`, in rank order, on rank 0 (None on the others). A step."
    if not active():
        return [obj]
    out = [None] * D.get_world_size() if D.get_rank() == 0 else None
    _arrive_then(step, lambda g: D.gather_object(obj, out, dst=0, group=g))
    return out


def broadcast(step: str, obj, src: int = 0):
    "Rank `src`'s `obj` (any picklable object) on every rank. A step."
    if not active():
        return obj
    box = [obj]
    _arrive_then(step, lambda g: D.broadcast_object_list(box, src=src, group=g))
    return box[0]


def agree_any(step: str, flags: int) -> int:
    "The bitwise OR of every rank's `flags` (small non-negative integers). A step."
    out = 0
    for f in exchange(step, int(flags)):
        out |= f
    return out


def all_gather_ints(step: str, values: list) -> list:
    "Every rank's list of integers `values`, in rank order. A step."
    return [list(v) for v in exchange(step, [int(v) for v in values])]


_CHUNK = 64 << 20


def share_file(step: str, path, src: int) -> Path:
    """Rank `src`'s file `path` on every rank: its own path on `src`, elsewhere a copy in a new temporary
    file (the caller removes it). For ranks whose disk does not hold a file that `src`'s does (node-local
    folders): sent over the gloo group in pieces of 64 MiB. A step."""
    if not active():
        return Path(path)
    me = D.get_rank()
    size = exchange(step, os.path.getsize(path) if me == src else None)[src]
    g = _steps().payload_group()

    def pieces(f, send: bool):
        done = 0
        while done < size:
            buf = torch.empty(min(_CHUNK, size - done), dtype=torch.uint8)
            if send:
                f.readinto(buf.numpy().data)
            D.broadcast(buf, src=src, group=g)
            if not send:
                f.write(buf.numpy().data)
            done += buf.numel()

    try:
        if me == src:
            with open(path, "rb") as f:
                pieces(f, True)
            return Path(path)
        fd, tmp = tempfile.mkstemp(prefix=".fastai_resume-shared-", suffix=".frk")
        try:
            with os.fdopen(fd, "wb") as out:
                pieces(out, False)
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)
    except RuntimeError as e:  # a rank died in the middle of it
        raise StepTimeout(f"fastai_resume: step {step!r}: rank {src}'s file {path} did not arrive: {e}") from None


@contextmanager
def fetch_missing(step: str, path):
    """`path` on every rank, for the `with` block: where some ranks' disks do not hold that file (node-local
    folders) and another rank's does, the ranks get a copy of the lowest such rank's in a temporary file,
    removed as the block ends. A step."""
    have = exchange(step, os.path.isfile(path))
    if all(have) or not any(have):
        yield Path(path)
        return
    got = share_file(f"{step} (sent by rank {have.index(True)})", path, have.index(True))
    try:
        yield got
    finally:
        if got != Path(path):
            got.unlink()


def sees_rank0(step: str, folder) -> list:
    """Which ranks' `folder` is rank 0's (a file system they share), as [bool per rank]: rank 0 puts a file of
    a new random name there (creating `folder` if need be) and every rank looks for it. Three steps; rank 0
    failing to write it (a read-only or full disk) raises on every rank."""
    if not active():
        return [True]
    probe = Path(folder) / f".fastai_resume-probe-{os.urandom(8).hex()}"  # (rank 0's name is the one looked for)

    def mark():
        if D.get_rank() == 0:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.touch()

    try:
        together(f"{step}: rank 0 marks its folder", mark)
        name = exchange(f"{step}: the mark's name", probe.name if D.get_rank() == 0 else None)[0]
        return exchange(f"{step}: who sees it", (Path(folder) / name).exists())
    finally:
        if D.get_rank() == 0:
            probe.unlink(missing_ok=True)


def is_dtensor(v) -> bool:
    "Is `v` a DTensor (a sharded model's parameter)? Nothing is imported: none exists before torch imports it."
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(v, mod.DTensor)


def sharded(model) -> bool:
    """Is `model` sharded across ranks: FSDP2's `fully_shard` made a module of it an `FSDPModule` (its
    parameters are DTensors, except while a forward holds them whole), or a parameter is a DTensor? Neither
    can exist before torch imports them: without them nothing is imported here."""
    if model is None:
        return False
    if _ASKED and id(model) in _ASKED[-1]:
        return _ASKED[-1][id(model)][1]
    fsdp, tensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    if fsdp is None and tensor is None:
        return False
    kinds = (fsdp.FSDPModule,) if fsdp is not None else ()
    dtensor = tensor.DTensor if tensor is not None else None
    found = any(
        isinstance(m, kinds) or (dtensor and any(isinstance(p, dtensor) for p in m._parameters.values()))
        for _, m in named_modules(model)  # (one walk: a resume's checks call this on every stage's start)
    )
    if _ASKED:
        _ASKED[-1][id(model)] = (model, found)
    return found


_ASKED: list = []  # within `one_answer`: {id(model): (model, sharded)}, {("modules", id(model), dedup): (model, pairs)}
_NAMED_PARAMETERS, _PARAMETERS = torch.nn.Module.named_parameters, torch.nn.Module.parameters


def named_modules(model, remove_duplicate: bool = True) -> list:
    "`list(model.named_modules(remove_duplicate=...))`, within `one_answer` walked once."
    key = ("modules", id(model), remove_duplicate)
    if _ASKED and key in _ASKED[-1]:
        return _ASKED[-1][key][1]
    out = list(model.named_modules(remove_duplicate=remove_duplicate))
    if _ASKED:
        _ASKED[-1][key] = (model, out)  # (the model kept: its id stays its own)
    return out


def named_parameters(model, remove_duplicate: bool = True) -> list:
    """`list(model.named_parameters(remove_duplicate=...))`, read from `named_modules`' walk as torch reads it
    (the parameters themselves read now: FSDP2 swaps them, its modules stay); a model that defines its own
    `named_parameters` or `parameters` is asked."""
    cls = type(model)
    if cls.named_parameters is not _NAMED_PARAMETERS or cls.parameters is not _PARAMETERS:
        return list(model.named_parameters(remove_duplicate=remove_duplicate))
    out, memo = [], set()
    for prefix, m in named_modules(model, remove_duplicate):
        dot = prefix + "." if prefix else ""
        for k, v in m._parameters.items():
            if v is None or v in memo:
                continue
            if remove_duplicate:
                memo.add(v)
            out.append((dot + k, v))
    return out


@contextlib.contextmanager
def one_answer():
    """Within it, `sharded` and `named_modules` walk each model once (`named_parameters` reads that walk): a save
    asks them in several places (nothing shards a model or adds a module in the middle of a save), and a save
    at every step of an LLM would walk its modules each time."""
    if _ASKED:  # (inside another: its answers)
        yield
        return
    _ASKED.append({})
    try:
        yield
    finally:
        _ASKED.pop()


def is_distributed_dl(dl) -> bool:
    "Is `dl` fastai's `DistributedDL` (or a subclass)?"
    return is_a(dl, "fastai.distributed", "DistributedDL")


def unwrap_dl(dl):
    "The DataLoader that owns the shuffling RNG: fastai's `DistributedDL` wraps the user's one."
    while is_distributed_dl(dl) and hasattr(dl, "dl"):
        dl = dl.dl
    return dl
