"""The evidence a stream's resume is checked against: what each training batch held since the newest save.

A stream says where it is through its own state (`loaders.stream_way`), which no one here can read. So
a fit whose training data is a stream writes, beside each resumable checkpoint it saves, a data log:
one line per training batch trained after that save, `epoch iter fingerprint` (a CRC32C of the batch's
tensors, their dtypes and shapes), appended as the batch starts (flushed: a killed process loses
nothing of it; a lost machine loses what its page cache held). The rerun that resumes from the
checkpoint fingerprints each batch it draws and compares it with the line of the same position
before the batch trains; the first one that differs stops the rerun on every rank, naming the batch.

The log is `<checkpoint>.datalog` (`.datalog.rankN` for rank N > 0), removed with its checkpoint
(`stored.remove`). A batch the killed run did not reach has no line, and is not checked: what is
proven is that every batch the killed run trained after its checkpoint is trained again, the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from . import dist, io, stored

__all__ = ["fingerprint", "text_digest", "DataLog", "expected", "StreamDiverged"]

_MASK = (1 << 64) - 1
_MAX_LINES = 1 << 22  # a log never holds more lines than this (a hostile or runaway file is not read past it)


class StreamDiverged(ValueError):
    "A resumed stream gives other data than the run that saved the checkpoint trained on."


def text_digest(v) -> int:
    return io.crc32c(repr(v).encode())  # the same in every process (unlike hash())


def fingerprint(t) -> int:
    "A digest of a tree of tensors and plain values (a batch): the same bytes, dtypes and shapes, the same digest."
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        head = text_digest((str(t.dtype), tuple(t.shape)))
        t = t.reshape(-1)
        return io.crc32c(t.view(torch.uint8).numpy() if t.numel() else b"", head)
    if isinstance(t, (list, tuple)):
        c = 0
        for x in t:
            c = ((c * 1000003) ^ fingerprint(x)) & _MASK
        return c
    if isinstance(t, Mapping):  # (a dict, or transformers' BatchEncoding)
        return fingerprint([text_digest(k) ^ fingerprint(v) for k, v in t.items()])
    if isinstance(t, np.ndarray):
        return fingerprint(torch.from_numpy(np.ascontiguousarray(t))) if t.dtype != object else text_digest(t.tolist())
    if isinstance(t, (int, float, bool, str)):
        return text_digest(t)
    return 0


def path_of(checkpoint: Path, rank: int) -> Path:
    return stored.data_log(Path(checkpoint), rank)


class DataLog:
    "The data log of the newest resumable save of this process's fit (one rank's)."

    def __init__(self):
        self.f = None

    @property
    def open(self) -> bool:
        return self.f is not None

    def start(self, checkpoint: Path) -> None:
        "A resumable save to `checkpoint`: the batches from now on go to its log (a new one)."
        self.close()
        try:
            Path(checkpoint).parent.mkdir(parents=True, exist_ok=True)  # (the save about to be made makes it too)
            self.f = open(path_of(checkpoint, dist.rank()), "w")  # noqa: SIM115  (open for the fit's life)
        except OSError:
            self.f = None  # (no folder yet, or no room: the rerun then checks nothing, as with no log)

    def record(self, epoch: int, it: int, digest: int) -> None:
        "Batch `it` of `epoch`, whose `fingerprint` is `digest`, starts training."
        if self.f is not None:
            try:
                self.f.write(f"{epoch} {it} {digest}\n")
                self.f.flush()
            except OSError:
                self.close()

    def close(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError:
                pass
            self.f = None


def expected(checkpoint: Path) -> dict:
    """{(epoch, iter): fingerprint} from the data log of `checkpoint` for this rank; empty without one. A line
    that is not three integers (a torn last line) ends what is read."""
    out: dict = {}
    try:
        with open(path_of(checkpoint, dist.rank()), "rb") as f:
            for _ in range(_MAX_LINES):
                line = f.readline(65)  # (a longer line is no line of ours: reading stops there)
                parts = line.split()
                if len(parts) != 3 or not all(p.isdigit() for p in parts) or not line.endswith(b"\n"):
                    break
                e, i, c = (int(p) for p in parts)
                out[(e, i)] = c
    except OSError:
        return {}
    return out


def verdict(source, epoch: int, it: int, want, got, what: str) -> None:
    """Every rank's comparison of one resumed batch, as one step: every rank raises if any rank's batch differs
    from its log's (never a rank training on while another stops)."""
    mine = None if want is None or want == got else f"rank {dist.rank()}" if dist.active() else "this process"
    wrong = [w for w in dist.exchange(f"datalog: batch {epoch},{it}", mine) if w is not None]
    if wrong:
        raise StreamDiverged(
            f"the resumed training data differs from what the run that saved {source} trained on: batch {it} "
            f"of epoch {epoch} ({', '.join(wrong)}) is not the batch that run trained there, or was not drawn (its "
            f"data log, {Path(str(source)).name}.datalog). The stream ({what}) did not resume where it was: its "
            "state_dict()/load_state_dict() does not hold all of its position, or it moved in worker processes. "
            "Nothing was trained on it. Options: give the stream a complete state (torchdata's StatefulDataLoader "
            "for worker processes), read it with num_workers=0, or fit with start_iter=0 to restart the epoch."
        )
