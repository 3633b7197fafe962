"""What a checkpoint holds of a model: what training can change, and fingerprints for the frozen rest.

Fine-tuning (LoRA adapters on a `transformers` model, fastai's `freeze()`d body) trains a small part of
a model. A checkpoint's `model` holds every tensor training can change: each parameter with
`requires_grad` (fastai's `train_bn` norms inside a frozen body among them, which a filter by name
misses), every buffer, anything else in the state dict, and any frozen parameter a rerun could not
reproduce by itself. Each other frozen parameter is recorded in the tree's `frozen` by fingerprint:

    "frozen": {name: {"crc": CRC32C of its bytes, "shape": [...], "dtype": "float32"}}
              (or "h64" instead of "crc": a tensor on an accelerator, fingerprinted where it lives: `h64`)

A rerun reproduces a frozen tensor when it is what the stage began with (`stage_began` takes the
fingerprints of the frozen parameters as each stage and each fit begins: the stage's base), and either
every earlier stage's end state was kept (a rerun restores it: `between`) or the tensor is what the
script's first stage began with (the script's base: a rerun that passes earlier stages without their end
states still builds that). Anything else is held in full: a frozen tensor changed in place (merge code,
an EMA written into the base, a callback writing `.data`, fastai's optimizer stepping a once-trained
frozen parameter that still has a zero gradient), or one an earlier stage trained. Each save
fingerprints the frozen parameters again: the CRC32C of a tensor whose pages are still those of a file
it was mapped from (`transformers`' `from_pretrained`) is the one read before (`provenance`), as is that
of a copy in the process's memory none of whose pages the kernel saw written since it was read
(`unwritten`); the rest are read (one pass, the hardware instruction on every core; `bench/llm.py`
measures each way).

A load checks the referenced tensors against the learner (`check`): another base, a missing or extra
tensor, another shape or dtype is refused, naming the first tensor that differs. A load that arms a
resume checks names, shapes and dtypes only, and, where the learner does not hold every referenced
tensor yet (`not_yet`: the script may load them before the fit, as `load_encoder` does) or the file
holds frozen tensors its stage changed (`held_frozen`), changes nothing in the learner (`patches`): the
resumed fit puts the checkpoint's state in, and refuses to start, on every rank, unless each referenced
tensor is what its stage began with (`recheck`, against the fingerprints the stage took anyway) and the
same parameters are frozen as when the checkpoint was saved (`trainstate`). `full=True` saves every
tensor; `store.make_full` writes a delta file's self-contained twin from the learner it is checked
against. A sharded (FSDP2) model's checkpoint is such a delta too: each rank holds its part of what trains,
and a frozen DTensor's fingerprint is the CRC32C of the whole tensor, combined from every rank's part (the
same at any world size, and the same as the unsharded tensor's: a checkpoint moves between world sizes
and checks its base at each), collective like the save and the load.
"""

from __future__ import annotations

import hashlib
import os

import torch

from . import dist, io, provenance, unwritten
from .fields import is_int, need, refused
from .io import CheckpointError
from .script import script

__all__ = [
    "fingerprints",
    "h64",
    "kind_of",
    "stage_began",
    "split",
    "validate",
    "stand_ins",
    "check",
    "not_yet",
    "held_frozen",
    "recheck",
    "is_delta",
]

_THREADS = min(8, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 1


def _bytes(t: torch.Tensor):
    "A tensor's bytes, in order, as a NumPy array (a copy only for a non-contiguous or device tensor)."
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _materialized(t) -> bool:
    "A tensor with bytes to fingerprint (not a `LazyLinear`'s uninitialized parameter, nor on the meta device)."
    return not isinstance(t, _UNINITIALIZED) and t.device.type != "meta"


_UNINITIALIZED = (torch.nn.parameter.UninitializedParameter, torch.nn.parameter.UninitializedBuffer)


ENV = "FASTAI_RESUME_FINGERPRINT"  # "h64": every tensor's fingerprint computed where it lives (tests, by choice)
_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_K1, _K2 = -7046029254386353131, 6364136223846793005  # (0x9E3779B97F4A7C15 as int64; an LCG's multiplier)
_H64_CHUNK = 1 << 24  # words per pass: bounds the temporaries (8 bytes a word, a few of them)
_MASK64 = (1 << 64) - 1


def h64(t: torch.Tensor, first_word: int = 0) -> int:
    """A tensor's fingerprint computed with torch operations on its own device (nothing copied to the host but
    one integer a pass): its bytes as words of its element's size (8 bytes at most: a complex128 is two), word
    i weighted by an odd 64-bit constant drawn from i, summed mod 2^64. Any one changed word changes it (an odd
    weight is invertible mod 2^64), integer sums are exact in any order (every device, every reduction gives
    the same), and a shard's partial sum (`first_word`: the global index of its first word) adds up with the
    others' to the whole tensor's. A checksum against accidents, as a CRC is, not against an adversary."""
    t = t.detach().contiguous().reshape(-1)
    w = t.view(_WORD[min(t.element_size(), 8)]) if t.dtype != torch.bool else t.view(torch.int8)
    total = 0
    for s in range(0, w.numel(), _H64_CHUNK):
        part = w[s : s + _H64_CHUNK].to(torch.int64)
        i = torch.arange(first_word + s, first_word + s + part.numel(), dtype=torch.int64, device=w.device)
        z = i * _K1
        z = (z ^ (z >> 31)) * _K2
        total += int((part * (z | 1)).sum())
    return _signed(total)


def _signed(v: int) -> int:
    "A sum mod 2^64 as the signed 64-bit integer a file stores (the format's integers are int64)."
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def _kind(t: torch.Tensor) -> str:
    "How a tensor is fingerprinted by default: where it lives ('h64': on a device) or by its bytes ('crc')."
    local = t.to_local() if dist.is_dtensor(t) else t  # type: ignore[attr-defined]
    return "h64" if local.device.type != "cpu" or os.environ.get(ENV) == "h64" else "crc"


def fingerprints(tensors: dict, kinds: dict | None = None) -> dict:
    """`{name: {crc | h64, shape, dtype}}` of `{name: tensor}`, each of the kind `kinds` names (a file's, to
    compare with), by default of its place (`_kind`): a CPU tensor's CRC32C (one whose bytes are a file region
    read before takes that read's CRC, `provenance`; the others are read on every core at once), a device
    tensor's `h64`, computed on the device. A tensor under several names (tied weights) is read once. A
    sharded model's DTensors (`_sharded`: collective, every rank calls it with the same names) get the whole
    tensor's, as if it were not sharded, from each rank's part; one placed otherwise than FSDP's rows per rank,
    or whole on every rank, gets none (it is held)."""
    idents = _idents(tensors, kinds)
    if idents is not None and _LAST and _LAST[0] == idents:  # the same views as the last call's: a save's base
        regions, last = _LAST[1], _LAST[2]
        if provenance.still(regions, {k: tensors[k] for k in regions}):  # (one scan of the pages)
            rest = {k: t for k, t in tensors.items() if k not in regions}
            more: dict = {}
            rest = _fingerprints(rest, kinds, more) if rest else {}
            if more:  # (regions known since: a file settled after the first read)
                _LAST[1:] = [{**regions, **more}, {**last, **{k: rest[k] for k in more if k in rest}}]
            return {k: rest[k] if k in rest else dict(last[k]) for k in tensors if k in rest or k in last}
    regions = {}
    out = _fingerprints(tensors, kinds, regions)
    _LAST[:] = [] if idents is None else [idents, regions, {k: out[k] for k in regions if k in out}]
    return out


_LAST: list = []  # the last `fingerprints` call's views, the file regions it proved, their fingerprints


def _idents(tensors: dict, kinds: dict | None) -> tuple | None:
    "What `fingerprints` was asked of (which views of which memory, which kinds); None: a DTensor among them."
    if any(map(dist.is_dtensor, tensors.values())):
        return None
    kinds = kinds or {}
    views = tuple((k, kinds.get(k), t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for k, t in tensors.items())
    return os.environ.get(ENV), views


def _fingerprints(tensors: dict, kinds: dict | None, regions: dict) -> dict:
    "`fingerprints`, each read or known; `regions` gets the names whose CRC32C is a file region's, and its key."
    kinds = {k: (kinds or {}).get(k) or _kind(t) for k, t in tensors.items()}
    whole = {k: t for k, t in tensors.items() if not dist.is_dtensor(t)}
    key = lambda t: (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)  # noqa: E731
    first: dict = {}
    for k, t in whole.items():
        first.setdefault((kinds[k], key(t)), k)
    crc = [k for k in first.values() if kinds[k] == "crc"]
    cpu = [k for k in crc if whole[k].device.type == "cpu"]
    read = lambda names: io.crc32c_many([_bytes(whole[k]) for k in names], _THREADS)  # noqa: E731
    unmapped = lambda names: list(unwritten.crcs({k: whole[k] for k in names}, read).values())  # noqa: E731
    got = provenance.crcs({k: whole[k] for k in cpu}, unmapped, regions)  # a file's bytes, or bytes unwritten: known
    for k in first.values():
        if k not in got:
            got[k] = io.crc32c_many([_bytes(whole[k])], _THREADS)[0] if kinds[k] == "crc" else h64(whole[k])
    out = {k: _fingerprint(t, kinds[k], got[first[(kinds[k], key(t))]]) for k, t in whole.items()}
    regions.update({k: regions[f] for k, t in whole.items() if (f := first[(kinds[k], key(t))]) in regions})
    parted = {k: t for k, t in tensors.items() if k not in whole}
    for k, v in _sharded(parted, kinds).items():
        if v is not None:  # (placed otherwise: no fingerprint, held)
            out[k] = _fingerprint(tensors[k], kinds[k], v)
    return {k: out[k] for k in tensors if k in out}


def _sharded(tensors: dict, kinds: dict) -> dict:
    """Each DTensor's whole fingerprint (row-major bytes, as the unsharded tensor's) from this rank's part:
    under FSDP's placement (`Shard(0)` on a 1-D mesh) the ranks' parts are consecutive rows, so the whole
    tensor's CRC32C is their CRCs combined in rank order, its `h64` their partial sums added (one exchange of
    two integers per tensor and rank); a replicated one is whole here. None: placed otherwise (not
    fingerprinted). Collective when any is given."""
    if not tensors:
        return {}
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mine = []
    for k, t in tensors.items():
        names = [type(p).__name__ for p in t.placements]
        how = "whole" if all(n == "Replicate" for n in names) else None
        every_rank = t.device_mesh.mesh.flatten().tolist() == list(range(dist.world()))  # (in rank order)
        if t.device_mesh.ndim == 1 and names == ["Shard"] and t.placements[0].dim == 0 and every_rank:
            how = "rows"
        local = t.to_local()
        value = 0
        if how is not None and kinds[k] == "crc":
            value = io.crc32c_many([_bytes(local)], _THREADS)[0]
        elif how is not None:
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            row = local[0].numel() if local.dim() and local.shape[0] else 0
            words = max(1, local.element_size() // 8)
            value = h64(local, first_word=int(offset[0]) * row * words if how == "rows" else 0)
        mine.append([how, value, local.numel() * local.element_size()])
    agreed = hashlib.sha1("\n".join(tensors).encode()).hexdigest()[:16]
    said = dist.exchange("the frozen tensors' fingerprints, every rank's part", [agreed, mine])
    if any(s[0] != agreed for s in said):  # (the same tensors, in the same order, on every rank)
        raise CheckpointError("the ranks fingerprint different frozen tensors: their models differ")
    rows = [s[1] for s in said]
    out: dict = {}
    for i, k in enumerate(tensors):
        how = mine[i][0]
        if how == "rows" and kinds[k] == "crc":
            v = 0
            for r in rows:
                v = io.crc32c_combine(v, r[i][1], r[i][2])
            out[k] = v
        elif how == "rows":
            out[k] = _signed(sum(r[i][1] for r in rows))
        else:
            out[k] = mine[i][1] if how == "whole" else None
    return out


def _fingerprint(t: torch.Tensor, kind: str, value: int) -> dict:
    return {kind: value, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def kind_of(f: dict) -> str:
    "A fingerprint's kind: 'crc' (CRC32C) or 'h64'."
    return "crc" if "crc" in f else "h64"


def _frozen_params(model) -> dict:
    "The frozen parameters by their state-dict names (a tied one under each of its names)."
    named = dist.named_parameters(model, remove_duplicate=False)
    return {k: p for k, p in named if not p.requires_grad and _materialized(p)}


def stage_began(learn, first_fit: bool = True) -> None:
    """A stage (`first_fit`) or a fit of it begins: the frozen parameters' fingerprints now are its base
    (those frozen since the stage began keep theirs); in the script's first stage, its base too."""
    from fastai.torch_core import get_model

    sc = script(learn)
    model = get_model(learn.model)
    known = {} if first_fit or sc.base is None else sc.base
    now = _frozen_params(model)
    sc.base = {**known, **fingerprints({k: p for k, p in now.items() if k not in known})}
    if not sc.signatures:  # the script's first stage
        sc.script_base = sc.base


def split(learn, sd: dict, full: bool = False) -> tuple[dict, dict | None]:
    """The state dict `sd` of the learner's model as a checkpoint holds it: `(held, frozen)`, `frozen`
    the fingerprints of the frozen parameters a rerun reproduces (None when every tensor is held)."""
    from fastai.torch_core import get_model

    model = get_model(learn.model)
    if full:
        return sd, None
    frozen = {k: sd[k] for k, p in _frozen_params(model).items() if k in sd and _same(sd[k], p)}
    if not frozen:
        return sd, None
    sc = script(learn)
    if sc.base is None:  # a save before any stage: what the learner holds now is what a rerun builds
        stage_began(learn)
    stage_base, script_base = sc.base or {}, sc.script_base or {}
    at = sc.stage.index if sc.stage is not None else len(sc.signatures)
    ends_kept = all(e is not None for e in sc.ends[:at])
    kinds = {k: kind_of(f) for k, f in stage_base.items()}  # (compared with those)
    refs = {
        k: f
        for k, f in fingerprints(frozen, kinds).items()
        if stage_base.get(k) == f and (ends_kept or script_base.get(k) == f)
    }
    if not refs:
        return sd, None
    return {k: v for k, v in sd.items() if k not in refs}, refs


def _same(v, p) -> bool:
    "Whether the state dict's entry is the parameter's own tensor (a module may put something else there)."
    ptr = lambda t: t.to_local().data_ptr() if dist.is_dtensor(t) else t.data_ptr()  # noqa: E731
    return isinstance(v, torch.Tensor) and v.shape == p.shape and ptr(v) == ptr(p)


def is_delta(tree) -> bool:
    "Whether a checkpoint tree leaves frozen tensors out (they must come from the learner)."
    return isinstance(tree, dict) and bool(tree.get("frozen"))


_DTYPES = {str(d).removeprefix("torch.") for d in io.TORCH_CODE}  # (those this torch has)


def validate(tree, path) -> None:
    "Raise `CheckpointError` when a tree's `frozen` field is malformed (before the learner is looked at)."
    refs = tree.get("frozen")
    if refs is None:
        return
    with refused(f"{path}: "):
        need(isinstance(refs, dict), "", f"'frozen' is a {type(refs).__name__}, expected a dict")
        for k, f in refs.items():
            _check_ref(k, f, f"frozen[{k!r:.80}]")
            need(
                k not in tree["model"],
                f"frozen[{k!r:.80}]",
                "also held in 'model' (a tensor is either held or referenced)",
            )


def _check_ref(k, f, where: str) -> None:
    "One frozen tensor's reference: name, fingerprint (CRC32C or h64), shape and dtype, of a size the format holds."
    need(
        isinstance(k, str) and isinstance(f, dict) and set(f) in ({"crc", "shape", "dtype"}, {"h64", "shape", "dtype"}),
        where,
        "expected a name and {crc or h64, shape, dtype}",
    )
    kind = kind_of(f)
    v, shape, dtype = f[kind], f["shape"], f["dtype"]
    lo, hi, what = (0, 1 << 32, "a 32-bit checksum") if kind == "crc" else (-(1 << 63), 1 << 63, "a 64-bit fingerprint")
    need(is_int(v, lo) and v < hi, f"{where}.{kind}", f"expected {what}, got {v!r:.40}")
    need(
        isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(is_int(n) and n < 1 << 63 for n in shape),
        f"{where}.shape",
        f"expected a list of at most {_MAX_NDIM} sizes, got {shape!r:.60}",
    )
    need(dtype in _DTYPES, f"{where}.dtype", f"{dtype!r:.40} is not a torch dtype")
    n = io.TORCH_DTYPE_SIZE[dtype]
    for d in shape:
        n *= d
        need(n < 1 << 63, f"{where}.shape", f"{shape!r:.60} is more than 2^63 bytes")


_MAX_NDIM = 32  # the format's own bound on a tensor's dimensions (csrc/frk.h: FRK_MAX_NDIM)


def stand_ins(refs: dict) -> dict:
    "The referenced tensors as meta tensors of their shape and dtype (no memory): for the key and shape checks."
    return {k: torch.empty(f["shape"], dtype=getattr(torch, f["dtype"]), device="meta") for k, f in refs.items()}


def check(model, tree, path, defer: bool = False, known: dict | None = None) -> dict | None:
    """Check the frozen tensors `tree` references against `model`'s (their shapes and dtypes were checked
    with the rest of the state dict): raise `CheckpointError` naming the first that differs. `known`:
    fingerprints taken since nothing changed them (a skipped stage's base, at its end). `defer` (a load
    that arms a resume, which changes nothing yet): only that the model has them; the resumed fit's
    `recheck` compares them with its stage's base (the script may load them before it, as `load_encoder`
    loads a classifier's encoder). Returns the references (None for a self-contained tree)."""
    refs = tree.get("frozen")
    if not refs:
        return None
    sd = model.state_dict()
    missing = [k for k in refs if k not in sd]
    if missing:
        raise CheckpointError(f"{path}: this learner's model has no {missing[0]} (a frozen tensor the file references)")
    if defer:
        return refs
    now = _now(sd, refs, known)
    k = next((k for k, want in refs.items() if now.get(k) != want), None)
    if k is not None:
        raise CheckpointError(_differs(path, k, refs[k], now.get(k)))
    return refs


def _now(sd: dict, refs: dict, known: dict | None) -> dict:
    """The fingerprints of the state dict's referenced tensors, each of its reference's kind (those in `known`
    of that kind not read again)."""
    kinds = {k: kind_of(f) for k, f in refs.items()}
    known = {k: f for k, f in (known or {}).items() if k in refs and kinds[k] in f}
    return {**known, **fingerprints({k: sd[k] for k in refs if k in sd and k not in known}, kinds)}


def not_yet(model, tree, known: dict | None = None) -> list:
    "The referenced tensors `model` does not hold yet (their names), `known` as in `check`."
    refs = tree.get("frozen") or {}
    if not refs:
        return []
    now = _now(model.state_dict(), refs, known)
    return [k for k, want in refs.items() if now.get(k) != want]


def held_frozen(model, tree) -> list:
    """The parameters a checkpoint saved mid-fit holds though they were frozen then (changed in place, or
    trained by an earlier stage whose end state was not kept): their stage must begin without them."""
    trainable = (tree.get("train") or {}).get("trainable")
    if not trainable:
        return []
    names = [k for k, _ in model.named_parameters()]
    return [k for k, t in zip(names, trainable) if not t and k in tree["model"]]


def recheck(learn, refs: dict | None, source) -> None:
    """As a resumed fit starts (its stage's base just taken, nothing trained): each referenced tensor must be
    what the stage began with, on every rank, or the fit is refused on every rank."""
    from fastai.torch_core import get_model

    bad = None
    if refs:
        base = script(learn).base or {}
        sd = get_model(learn.model).state_dict()
        missing = [k for k in refs if k not in sd]
        if missing:
            bad = f"{source}: this learner's model has no {missing[0]} (a frozen tensor the file references)"
        else:
            now = _now(sd, refs, base)
            k = next((k for k, want in refs.items() if now.get(k) != want), None)
            if k is not None:
                bad = _differs(source, k, refs[k], now.get(k)) + " (checked as the resumed fit starts)"
    # every rank refuses together
    dist.verdict(
        "the resumed fit's frozen tensors", bad, own=CheckpointError(bad) if bad else None, failed="{failures}"
    )


def _differs(path, name, want, got) -> str:
    if got is None:  # (a sharded model's tensor placed otherwise than FSDP's rows per rank)
        return (
            f"{path}: the frozen tensor {name} cannot be checked in this model (sharded otherwise than by rows per "
            "rank): load a self-contained checkpoint (saved with full=True, or made by fastai_resume.make_full)"
        )
    what = (
        f"shape {want['shape']} in the file, {got['shape']} here"
        if want["shape"] != got["shape"]
        else f"dtype {want['dtype']} in the file, {got['dtype']} here"
        if want["dtype"] != got["dtype"]
        else f"CRC32C {want['crc']:08x} in the file, {got['crc']:08x} here"
        if kind_of(want) == "crc"
        else f"fingerprint (h64) {want['h64'] & _MASK64:016x} in the file, {got['h64'] & _MASK64:016x} here"
    )
    return (
        f"{path}: the frozen tensor {name} is not the one this checkpoint was saved with ({what}): the learner "
        "was built on another base model, or with other frozen weights. Build it on the base the run trained "
        "on; a checkpoint saved with full=True holds every tensor."
    )
