"""The command-line tool: `python -m fastai_resume` (or `fastai-resume`).

    inspect FILE          format, training position, tensors, RNG and loop state, checksums; of a
                          sharded checkpoint (a folder) its manifest, every rank's file and which rank
                          wrote which part of each tensor
    verify FILE_OR_DIR    one line per checkpoint (OK, or BAD and what is wrong); a folder's other
                          files are skipped, each on a SKIP line, and a summary line ends the list; a
                          sharded checkpoint is one checkpoint (its manifest and every shard); both take a
                          URL too, `s3://bucket/run/...` (`_remote_inspect`, `_remote_verify`)
    convert SRC DST       fastai_resume checkpoint (a file or a sharded folder) -> vanilla fastai .pth
                          (for deployment), or back; `--to dcp`: a DCP checkpoint (torch.distributed.
                          checkpoint), and a DCP checkpoint back into a fastai_resume file
    check SCRIPT [ARGS]   does this training script resume exactly? (runs it 3 or 4 times, short)

Exit status: 0 when all is well; 1 when `verify` finds a file that is not a valid checkpoint,
`inspect` a checksum that fails, or `check` a difference; 2 on an error (a missing file, a file
that is not what the command needs, a file that cannot be written), told in one line on stderr that names the file.

A file's content is untrusted: a tree that says it is a Learner checkpoint (it has the schema key
or a training state) is checked as `learn.load` checks it before any command reads a field of it;
a malformed one is BAD for `verify` and an error (exit 2) for the others, never a traceback.

The tool needs neither fastai nor a GPU: it prints its output and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import io as _io
import os
import posixpath
import re
import stat
import sys
import tempfile
from pathlib import Path

from . import checkpoint, dcp, frozen, io, objstore, pth, shardfiles, stored
from .check import check
from .io import CheckpointError
from .paths import MANIFEST
from .state import plain

_MAGIC_LEN = 8  # the format's magic bytes (docs/FORMAT.md): a shorter file can only be a cut checkpoint


class Failure(Exception):
    "An expected user error: its message names the file and says what is wrong."


def _head(path) -> tuple:
    "(first bytes, size) of a regular file; never blocks on a FIFO or a device."
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise Failure(f"{path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Failure(f"{path}: is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise Failure(f"{path}: is not a regular file")
        return os.pread(fd, _MAGIC_LEN, 0), st.st_size
    finally:
        os.close(fd)


def _claims_format(head: bytes, size: int) -> bool:
    "True for a file this format must read (magic bytes), or one too short to tell (a cut checkpoint)."
    return size < _MAGIC_LEN or io.has_magic(head)


def _not_ours(head: bytes) -> str:
    if head.startswith(pth.ZIP):
        return (
            "a torch.save file (such as a vanilla fastai .pth), not a fastai_resume checkpoint "
            "(`fastai-resume convert` turns one into the other)"
        )
    return "not a fastai_resume checkpoint (no magic bytes)"


def _reason(e: Exception, path) -> str:
    "An error's message without the path it starts with (the caller names the file)."
    msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    msg = next((line.strip() for line in msg.splitlines() if line.strip()), type(e).__name__)
    for lead in (f"{path}: ", f"{path} "):
        if msg.startswith(lead):
            return msg[len(lead) :]
    return msg


def _claims_learner(tree) -> bool:
    "Whether a tree says it is a Learner checkpoint: it has the schema key or a training state."
    return isinstance(tree, dict) and ("fastai_resume" in tree or "train" in tree)


def _check_learner(tree, path) -> None:
    """Raises `CheckpointError`, naming the file and the part, where a tree that says it is a Learner
    checkpoint is malformed: what `learn.load` refuses (`checkpoint.check`). An `info()` tree's tensor
    entries are checked through data-less stand-ins."""
    if _claims_learner(tree):
        try:
            train = io.stand_ins(tree.get("train"))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        checkpoint.check({**tree, "train": train}, path)


def _is_sharded(p: Path) -> bool:
    "A folder that is a sharded checkpoint, or is named as one (then BAD if it is not one)."
    return p.is_dir() and ((p / MANIFEST).is_file() or p.name.endswith(io.EXT))


def _problem(path) -> str | None:
    "What is wrong with `path` as a checkpoint, or None when it is complete and every checksum verifies."
    if _is_sharded(Path(path)):
        return shardfiles.problem(path)
    head, size = _head(path)
    if not _claims_format(head, size):
        return _not_ours(head)
    try:
        _check_learner(io.info(path, verify=True)["tree"], path)
    except (CheckpointError, OSError) as e:
        return _reason(e, path)
    return None


def _walk(v, path=""):
    "(path, leaf) for every tensor placeholder in an info() tree."
    if isinstance(v, io._TensorRef):
        yield path, v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _walk(x, f"{path}.{k}" if path else str(k))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _walk(x, f"{path}[{i}]")


def _nbytes(ref):
    import numpy as np

    n = int(np.prod(ref.shape)) if ref.shape else 1
    return n * int(io.dtype_size(ref.code))


def _print_position(p) -> None:
    print(
        f"position: epoch {p['epoch']} of {p['n_epoch']}, {p['iter']} of {p['n_iter']} training batches done "
        f"(batch size {p['bs']}, fit {p['fit_index']}, train_iter {p['train_iter']}, "
        f"pct_train {p['pct_train']:.4f})"
    )


def _part(offset, local, shape) -> str:
    "A chunk's place in its tensor: `[0:19]` (rows 0 to 18, whole in the other dimensions), or `whole`."
    if local is None:
        return "?"
    dims = [(o, n, g) for o, n, g in zip(offset, local, shape)]
    while dims and dims[-1][0] == 0 and dims[-1][1] == dims[-1][2]:
        dims.pop()
    return "[" + ", ".join(f"{o}:{o + n}" for o, n, _ in dims) + "]" if dims else "whole"


def _inspect_sharded(a) -> int:
    d = shardfiles.describe(a.file)
    m, ranks = d["manifest"], d["ranks"]
    bad = [r for r in ranks if r["problem"]]
    state = "all checksums verify" if not bad else f"{len(bad)} of {len(ranks)} rank files BAD"
    print(
        f"{a.file}: sharded checkpoint of {m['world_size']} ranks (save {m['token']:016x}, manifest schema "
        f"{m['fastai_resume_sharded']}), {sum(r['size'] for r in ranks):,} bytes in {len(ranks)} files and "
        f"{MANIFEST}; {state}"
    )
    tree = d["tree"]
    if tree is not None:
        _check_learner({k: v for k, v in tree.items() if k != "shard"}, a.file)  # before a field of it is read
        train = tree.get("train")
        if train:
            _print_position(train["position"])
        else:
            print("position: none (saved outside fit: loading it never skips work)")
    for r in ranks:
        print(
            f"rank {r['rank']}: {r['file']}, {r['size']:,} bytes, " + (f"BAD: {r['problem']}" if r["problem"] else "ok")
        )
    table: dict = {}
    for r in ranks:
        for key, shape, offset, local in r["chunks"]:
            table.setdefault(key, (shape, []))[1].append((r["rank"], offset, local))
    print(f"{len(table)} sharded tensors (global shape, each rank's part); the rest is each rank's own")
    if not a.brief:
        for key, (shape, parts) in table.items():
            where = "  ".join(f"rank {r}: {_part(o, n, shape)}" for r, o, n in parts)
            print(f"  {key:40s} {str(list(shape)):16s} {where}")
    return 1 if bad else 0


def cmd_inspect(a):
    if Path(a.file).is_dir():
        if _is_sharded(Path(a.file)):
            return _inspect_sharded(a)
        if dcp.is_dcp(a.file):
            raise Failure(
                f"{a.file}: a DCP checkpoint (torch.distributed.checkpoint); `fastai-resume convert` imports it"
            )
        raise Failure(f"{a.file}: is a folder, not a file (nor a sharded or a DCP checkpoint)")
    head, size = _head(a.file)
    if not _claims_format(head, size):
        raise Failure(f"{a.file}: {_not_ours(head)}")
    info = io.info(a.file, verify=False)
    tree = info["tree"]
    _check_learner(tree, a.file)  # before a field of it is read
    try:
        io.info(a.file, verify=True)
        verified, status = "all checksums verify", 0
    except CheckpointError as e:
        verified, status = f"CHECKSUM FAILURE: {_reason(e, a.file)}", 1
    print(
        f"{a.file}: fastai_resume format v{info['version']}, {info['size']:,} bytes, "
        f"{len(info['blobs'])} blobs, {len(info['tensors'])} tensors; {verified}"
    )
    train = tree.get("train") if isinstance(tree, dict) else None
    if isinstance(tree, dict) and "model" in tree:
        if train:
            _print_position(train["position"])
            rec = train.get("recorder") or {}
            print(
                f"recorder: {len(rec.get('values', []))} epochs of metrics, "
                f"smooth-loss count {rec.get('smooth_count')}; "
                f"rng: python, numpy, torch{', cuda' if 'cuda' in train['rng'] else ''}; "
                f"callbacks: {', '.join(map(str, train['callbacks'])) or 'none'}"
            )
        else:
            print("position: none (saved outside fit: loading it never skips work)")
    total = 0
    for path, ref in _walk({k: v for k, v in tree.items() if k != "train"} if isinstance(tree, dict) else tree):
        size = _nbytes(ref)
        total += size
        if not a.brief:
            print(f"  {path:60s} {str(ref.dtype):16s} {str(list(ref.shape)):20s} {size:>12,}")
    print(f"tensors: {total:,} bytes")
    refs = tree.get("frozen") if isinstance(tree, dict) else None
    if refs:  # (validated by _check_learner)
        sizes = {k: _numel(f["shape"]) * io.TORCH_DTYPE_SIZE[f["dtype"]] for k, f in refs.items()}
        print(
            f"frozen, by fingerprint (not held): {len(refs)} tensors, {sum(sizes.values()):,} bytes: loading "
            "checks the learner's against them"
        )
        if not a.brief:
            for k, f in refs.items():
                kind = frozen.kind_of(f)
                fp = f"crc32c {f['crc']:08x}" if kind == "crc" else f"h64 {f['h64'] & (1 << 64) - 1:016x}"
                print(f"  {k:60s} {f['dtype']:16s} {str(f['shape']):20s} {sizes[k]:>12,} {fp}")
    return status


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _scan(folder: Path):
    "(path, None) for each checkpoint in `folder`, (path, why) for each other entry, by name."
    for p in sorted(folder.iterdir()):
        if stored.is_temp(p.name):
            yield p, "a save's temporary file (a save in progress, or left by a killed one)"
        elif p.name.endswith(".corrupt"):
            yield p, "set aside as corrupt by autoresume"
        elif _is_sharded(p):
            yield p, None  # a sharded checkpoint: one entry, its manifest and every shard
        elif p.is_dir():
            yield p, "a folder, not a checkpoint"
        else:
            try:
                head, size = _head(p)
            except Failure as e:
                yield p, _reason(e, p)
                continue
            # a file with the magic bytes, or named as one of ours, is a checkpoint: BAD if broken
            yield p, (None if p.name.endswith(io.EXT) or io.has_magic(head) else _not_ours(head))


def cmd_verify(a):
    target = Path(a.target)
    if _is_sharded(target):
        return _verify_sharded(target)
    if target.is_dir():
        entries = list(_scan(target))
    else:
        _head(target)  # a missing path, a FIFO: an error, not a verdict
        entries = [(target, None)]
    ok = bad = skipped = 0
    for f, skip in entries:
        if skip:
            skipped += 1
            print(f"SKIP {f}: {skip}")
            continue
        problem = _problem(f)
        if problem:
            bad += 1
            print(f"BAD  {f}: {problem}")
        else:
            ok += 1
            print(f"OK   {f}" + (" (sharded)" if f.is_dir() else ""))
    if target.is_dir():
        print(f"{ok} ok, {bad} bad, {skipped} skipped")
        if ok + bad == 0:
            raise Failure(
                f"{target}: no fastai_resume checkpoint in this folder "
                f"({skipped} other {'entry' if skipped == 1 else 'entries'} skipped)"
            )
    return 1 if bad else 0


def _verify_sharded(target: Path) -> int:
    "One sharded checkpoint: its verdict, then its manifest and every rank's file, each on a line."
    why = shardfiles.problem(target)
    try:
        m = shardfiles.read_manifest(target)
    except CheckpointError:
        m = None
    what = f" (sharded, {m['world_size']} ranks, save {m['token']:016x})" if m else ""
    print(f"OK   {target}{what}" if why is None else f"BAD  {target}{what}: {why}")
    if m is not None:
        print(f"       {MANIFEST}")
        for s in m["shards"]:
            print(f"       rank {s['rank']}: {s['file']}")
    return 0 if why is None else 1


def _write_atomically(write, dst: Path):
    "Calls write(file) on a temporary file beside `dst`, then renames it over `dst`: complete, or absent."
    try:
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.tmp.")
    except OSError as e:
        raise Failure(f"{dst}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        os.unlink(tmp)
        raise Failure(f"{dst}: cannot write: {e.strerror}") from None
    except BaseException:
        os.unlink(tmp)
        raise


def _holds_every_tensor(tree: dict, src) -> None:
    if tree.get("frozen"):
        raise Failure(
            f"{src}: references {len(tree['frozen'])} frozen tensors it does not hold (the base of a "
            "fine-tuning run); make a self-contained file first, with the learner built on that base: "
            "fastai_resume.make_full(learn, src, dst), or learn.save(name, with_iter=True, full=True)"
        )


def _source(src: Path, head: bytes | None, size: int) -> tuple:
    "What `convert` reads: (model state dict, optimizer state or None, what it is)."
    if src.is_dir():
        if dcp.is_dcp(src):
            tree = dcp.read(src)
            what = "a DCP checkpoint"
        elif _is_sharded(src):
            tree = shardfiles.gathered(src)  # every tensor whole, in this one process
            _check_learner(tree, src)
            _holds_every_tensor(tree, src)
            what = "a sharded checkpoint"
        else:
            raise Failure(f"{src}: is a folder, not a file (nor a sharded or a DCP checkpoint)")
        import torch

        model = tree.get("model") if isinstance(tree, dict) else None
        if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
            raise Failure(f"{src}: {what} without a model state dict ('model')")
        return model, tree.get("opt"), what
    if _claims_format(head or b"", size):
        tree = io.load(src)
        if not isinstance(tree, dict) or "model" not in tree:
            raise Failure(f"{src}: a fastai_resume file, but not a Learner checkpoint (no 'model')")
        _check_learner(tree, src)
        if not isinstance(tree["model"], dict):
            raise Failure(f"{src}: 'model' is a {type(tree['model']).__name__}, not a state dict")
        _holds_every_tensor(tree, src)
        return tree["model"], tree.get("opt"), "a fastai_resume checkpoint"
    model, opt = pth.read(src, head or b"")
    return model, opt, "a torch.save file"


def cmd_convert(a):
    src, dst = Path(a.src), Path(a.dst)
    head, size = (None, 0) if src.is_dir() else _head(src)
    if a.to == "dcp":
        if dst.exists():
            raise Failure(f"{dst}: exists; name a new folder for the DCP checkpoint")
    elif dst.is_dir():
        raise Failure(f"{dst}: is a folder; name the file to write")
    if not dst.parent.is_dir():
        raise Failure(f"{dst}: folder {dst.parent} does not exist")
    if dst.exists() and os.path.samefile(src, dst):
        raise Failure(f"{dst}: is the source file; name another file")
    model, opt, what = _source(src, head, size)
    if a.model_only:
        opt = None
    to = a.to or ("frk" if what in ("a torch.save file", "a DCP checkpoint") else "pth")
    if to == "pth":
        import torch

        out = {"model": model, "opt": opt} if opt is not None else model
        _write_atomically(lambda f: torch.save(out, f), dst)
        print(f"wrote {dst} (vanilla fastai: learn.load / torch.load read it)")
    elif to == "frk":
        tree = {"fastai_resume": 1, "model": model}
        if opt is not None:
            tree["opt"] = opt
        try:
            io.save(plain(tree), dst)
        except TypeError as e:
            raise Failure(f"{src}: {e}") from None
        print(f"wrote {dst} (fastai_resume format, no training position)")
    else:
        tmp = dst.with_name(f".{dst.name}.tmp.{os.getpid()}")
        try:
            dcp.export({"model": model, **({"opt": opt} if opt is not None else {})}, tmp)
            os.rename(tmp, dst)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"wrote {dst} (a DCP checkpoint: torch.distributed.checkpoint.load reads it, at any sharding)")


def cmd_check(a):
    if not Path(a.script).is_file():
        raise Failure(f"{a.script}: no such script")
    kill_at = tuple(int(x) for x in a.kill_at.split(",")) if a.kill_at else None
    if kill_at is not None and len(kill_at) != 3:
        raise Failure("--kill-at wants STAGE,EPOCH,BATCH")
    r = check(a.script, a.args, kill_at=kill_at, batches=a.batches)
    print(("OK   " if r.ok else "DIFF ") + r.message)
    return 0 if r.ok else 1


# ---- the same commands on a remote file or folder (a URL) -------------------------------------------


def _remote_scan(url: str):
    """A remote folder's objects for `verify`: (name, None) for each to verify, (name, why) for each other one
    (markers, the lease, an upload without its marker)."""
    fs, root = objstore.filesystem(url)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise FileNotFoundError(None, f"{url}: no such remote folder") from None
    names = sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries)
    have = set(names)  # (a sharded checkpoint is a folder there: its marker names each rank's file)
    folders = {posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"}
    for n in names:
        if n.endswith(objstore.MARKER) and n[: -len(objstore.MARKER)] in have:
            yield n, f"the marker of {n[: -len(objstore.MARKER)]} (its upload is complete)"
        elif n.endswith(objstore.CORRUPT) or n + objstore.CORRUPT in have:
            yield n, "set aside as corrupt by autoresume (the marker of a copy that did not verify)"
        elif n in folders and n + objstore.MARKER not in have and not re.search("-" + stored.AUTO_NAME, n):
            yield n, "a folder without a marker: not a checkpoint"
        elif n.startswith(".") and n.endswith(".lock"):
            yield n, "a run's lock (the process mirroring it)"
        elif n.endswith(io.EXT) and n + objstore.MARKER not in have and re.search("-" + stored.AUTO_NAME, n):
            yield n, "an upload without its marker (in progress, or killed): not a checkpoint yet"
        else:
            yield n, None


def _remote_inspect(a) -> int:
    "`fastai-resume inspect URL`: the command run on a downloaded copy, its output naming the URL."
    url = a.file
    with objstore.local_copy(url) as local:
        a.file = str(local)
        buf = _io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                return cmd_inspect(a)
        except (OSError, CheckpointError, ValueError) as e:
            raise type(e)(str(e).replace(str(local), url)) from None
        finally:
            sys.stdout.write(buf.getvalue().replace(str(local), url))


def _remote_verify(url: str) -> int:
    """`fastai-resume verify URL`: a remote file, or each object of a remote folder, as `verify` does a local
    one (OK, BAD and why, SKIP and why; a summary line for a folder). Each checkpoint is downloaded to a
    temporary folder and checked against its upload's marker, then as a local file is (`_problem`)."""
    folder = objstore.is_folder(url)
    base = url if url.endswith("/") else url + "/"
    entries = _remote_scan(url) if folder else [(None, None)]
    ok = bad = skipped = 0
    for name, skip in entries:
        shown = base + name if name is not None else url
        if skip:
            skipped += 1
            print(f"SKIP {shown}: {skip}")
            continue
        try:
            with objstore.local_copy(shown) as local:
                why = _problem(local)
        except CheckpointError as e:
            why = str(e).replace(objstore.filesystem(shown)[1] + ": ", "")
        if why:
            bad += 1
            print(f"BAD  {shown}: {why}")
        else:
            ok += 1
            print(f"OK   {shown}")
    if folder:
        print(f"{ok} ok, {bad} bad, {skipped} skipped")
        if ok + bad == 0:
            raise FileNotFoundError(None, f"{url}: no fastai_resume checkpoint in this remote folder")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="fastai-resume", description="Inspect, verify and convert fastai_resume checkpoints."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="what a checkpoint holds; exit 1 if a checksum fails")
    p.add_argument("file")
    p.add_argument("--brief", action="store_true", help="no per-tensor lines")
    p = sub.add_parser("verify", help="check every checksum; exit 1 if a file is not a valid checkpoint")
    p.add_argument("target", metavar="FILE_OR_DIR")
    p = sub.add_parser(
        "convert", help="fastai_resume (a file or a sharded folder) <-> vanilla fastai .pth or DCP (told by content)"
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--to",
        choices=("pth", "frk", "dcp"),
        default=None,
        help="what to write (default: a fastai_resume checkpoint becomes .pth, anything else .frk)",
    )
    p.add_argument("--model-only", action="store_true", help="write only the model's state dict")
    p = sub.add_parser(
        "check", help="run a training script uninterrupted, killed and resumed; report the first difference (exit 1)"
    )
    p.add_argument(
        "--kill-at",
        default=None,
        metavar="STAGE,EPOCH,BATCH",
        help="where to kill (default: mid second epoch of the last stage that has one)",
    )
    p.add_argument("--batches", type=int, default=8, help="training and validation batches per epoch (default 8)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("inspect", "verify") and objstore.is_url(a.file if a.cmd == "inspect" else a.target):
            return _remote_inspect(a) if a.cmd == "inspect" else _remote_verify(a.target)
        return {"inspect": cmd_inspect, "verify": cmd_verify, "convert": cmd_convert, "check": cmd_check}[a.cmd](a) or 0
    except (Failure, CheckpointError, OSError, ImportError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        print(f"fastai-resume {a.cmd}: error: {msg.splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
