"""The command-line tool: `python -m fastai_resume` (or `fastai-resume`).

    inspect FILE          format, training position, tensors, RNG and loop state, checksums
    verify FILE_OR_DIR    one line per checkpoint; exit status 1 if any is bad
    convert SRC DST       fastai_resume checkpoint -> vanilla fastai .pth (for deployment), or back

Errors are one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import io
from .io import CheckpointError


def _walk(v, path=""):
    "(path, leaf) for every tensor placeholder in an info() tree."
    if isinstance(v, io._TensorRef): yield path, v
    elif isinstance(v, dict):
        for k, x in v.items(): yield from _walk(x, f"{path}.{k}" if path else str(k))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v): yield from _walk(x, f"{path}[{i}]")


def _nbytes(ref):
    import numpy as np
    n = int(np.prod(ref.shape)) if ref.shape else 1
    return n * int(io._core.dtype_size(ref.code))


def cmd_inspect(a):
    info = io.info(a.file, verify=False)
    try:
        io.info(a.file, verify=True)
        verified = "all checksums verify"
    except CheckpointError as e:
        verified = f"CHECKSUM FAILURE: {e}"
    tree = info["tree"]
    print(f"{a.file}: fastai_resume format v{info['version']}, {info['size']:,} bytes, "
          f"{len(info['blobs'])} blobs, {len(info['tensors'])} tensors; {verified}")
    train = tree.get("train") if isinstance(tree, dict) else None
    if isinstance(tree, dict) and "model" in tree:
        if train:
            p = train["position"]
            print(f"position: epoch {p['epoch']} of {p['n_epoch']}, {p['iter']} of {p['n_iter']} training batches done "
                  f"(batch size {p['bs']}, fit {p['fit_index']}, train_iter {p['train_iter']}, pct_train {p['pct_train']:.4f})")
            rec = train.get("recorder") or {}
            print(f"recorder: {len(rec.get('values', []))} epochs of metrics, smooth-loss count {rec.get('smooth_count')}; "
                  f"rng: python, numpy, torch{', cuda' if 'cuda' in train['rng'] else ''}; "
                  f"callbacks: {', '.join(train['callbacks']) or 'none'}")
        else:
            print("position: none (saved outside fit: loading it never skips work)")
    total = 0
    for path, ref in _walk({k: v for k, v in tree.items() if k != "train"} if isinstance(tree, dict) else tree):
        size = _nbytes(ref)
        total += size
        if not a.brief: print(f"  {path:60s} {str(ref.dtype):16s} {str(list(ref.shape)):20s} {size:>12,}")
    print(f"tensors: {total:,} bytes")


def cmd_verify(a):
    target = Path(a.target)
    files = sorted(p for p in target.iterdir() if p.is_file() and p.suffix in (io.EXT, ".pth")) if target.is_dir() else [target]
    bad = 0
    for f in files:
        if not io.is_checkpoint(f):
            print(f"SKIP {f}: not a fastai_resume checkpoint")
            continue
        try:
            io.info(f, verify=True)
            print(f"OK   {f}")
        except (CheckpointError, OSError) as e:
            bad += 1
            print(f"BAD  {f}: {e}")
    return 1 if bad else 0


def cmd_convert(a):
    import torch
    src, dst = Path(a.src), Path(a.dst)
    if io.is_checkpoint(src):
        tree = io.load(src)
        if not isinstance(tree, dict) or "model" not in tree:
            raise CheckpointError(f"{src} is not a Learner checkpoint (no 'model')")
        out = {"model": tree["model"], "opt": tree["opt"]} if "opt" in tree and not a.model_only else tree["model"]
        torch.save(out, dst)
        print(f"wrote {dst} (vanilla fastai: learn.load / torch.load read it)")
    else:
        import numpy as np
        from fastcore.foundation import L
        from .state import plain
        safe = [L, np.core.multiarray.scalar, np.dtype, *[getattr(np.dtypes, d) for d in np.dtypes.__all__]]
        with torch.serialization.safe_globals(safe):
            st = torch.load(src, map_location="cpu", weights_only=True)
        tree = {"fastai_resume": 1, **({"model": st["model"], "opt": st["opt"]} if set(st) == {"model", "opt"} else {"model": st})}
        io.save(plain(tree), dst)
        print(f"wrote {dst} (fastai_resume format, no training position)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="fastai-resume", description="Inspect, verify and convert fastai_resume checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="what a checkpoint holds")
    p.add_argument("file")
    p.add_argument("--brief", action="store_true", help="no per-tensor lines")
    p = sub.add_parser("verify", help="check every checksum; exit 1 if any file is bad")
    p.add_argument("target", metavar="FILE_OR_DIR")
    p = sub.add_parser("convert", help="fastai_resume <-> vanilla fastai .pth")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--model-only", action="store_true", help="write only the model's state dict")
    a = ap.parse_args(argv)
    try:
        return {"inspect": cmd_inspect, "verify": cmd_verify, "convert": cmd_convert}[a.cmd](a) or 0
    except (CheckpointError, OSError, ValueError, KeyError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"fastai-resume {a.cmd}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
