"""Checkpoint I/O benchmark: this format against torch.save/torch.load(mmap), safetensors and the
physical limits of the same bytes, in one run, on the disk and on tmpfs, with fsync for every
contender, in interleaved rounds (medians with min-max; every ratio is paired by round).

State: torchvision's ViT-L/16 (about 1.1 GiB of float32 parameters, randomly initialised: nothing
is downloaded) plus Adam's two moment buffers. Save = serialise + write + fsync. Load = open, then
read every tensor (`touch_all`: the max over every byte of each): a lazy (mmap-based) load pays
for its pages there. The "write" figures are load, then every tensor written once in place
(`write_all`), as a resumed training step does to the state it loaded (Adam updates its moments
and the parameters in place): a load that maps the file pays there for a private copy of each
page (copy-on-write).
On a disk each load is timed with a cold page cache (the file's pages dropped, their absence
checked with mincore), then warm (the file read through the page cache just before, whichever
contender wrote it, and the fraction resident checked), then warm again for the write; tmpfs has
no cold case (its page cache is the storage). Before every timed load as much memory as the file is touched and freed
(`warm_memory`: a virtual machine's host faults otherwise decide the result).

Contenders: `fastai_resume.load` (verified: every blob's CRC32C checked, tensors in memory of the
process's own), `fastai_resume.load(mmap=True)` (verified, zero copy), torch.load(mmap=True),
safetensors' load_file (it maps the file: zero copy, nothing verified) and, where safetensors has
it, its load into memory of its own (`backend="pread"`, nothing verified: the like of ours); and
three physical limits of a load into memory of its own: read() into a buffer whose pages were
touched before the timer started, a copy from the page cache into such a buffer (the file mapped,
then torch's copy_, on its threads), and fresh memory of the file's size written once with no file
at all (what acquiring the memory alone costs). Prints a table, writes JSON
(bench/results/io.json).

    python bench/io.py [--dir DIR ...] [--rounds 5] [--small]
"""

import argparse
import ctypes
import gc
import mmap
import os
import shutil
import sys
import threading
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402
import report  # noqa: E402

import fastai_resume as fr  # noqa: E402


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    "Samples the resident set every 2 ms while the block runs; .extra = peak above the start."

    def __enter__(self):
        self.base, self.peak, self.stop = rss(), rss(), False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *a):
        self.stop = True
        self.t.join()
        self.extra = max(0, self.peak - self.base)


def make_state(small):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16() if small else torchvision.models.vit_l_16()
    params = {k: v.detach() for k, v in model.state_dict().items()}
    opt = {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
            for i, p in enumerate(params.values())
            if p.is_floating_point()
        },
        "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(params)))}
        ],
    }
    return {"model": params, "opt": opt}


def flat(tree):
    out = {f"model.{k}": v for k, v in tree["model"].items()}
    for i, s in tree["opt"]["state"].items():
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v
    return out


def fsync_path(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


def resident(p) -> float:
    "The fraction of the file's pages that are in the page cache (mincore)."
    n = os.path.getsize(p)
    if not n:
        return 0.0
    page = os.sysconf("SC_PAGE_SIZE")
    with open(p, "rb") as f:
        m = mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ)
    a = np.frombuffer(m, dtype=np.uint8)
    vec = (ctypes.c_ubyte * ((n + page - 1) // page))()
    rc = _libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(n), vec)
    del a
    m.close()
    if rc:
        raise OSError(ctypes.get_errno(), f"mincore {p}")
    return float(np.frombuffer(vec, dtype=np.uint8).__and__(1).mean())


def drop_cache(p) -> float:
    """Drop the file's pages from the page cache (fadvise; where pages stay, the whole page cache,
    if this process may); returns the fraction of them left resident."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = resident(p)
    if left > 0.01 and os.access("/proc/sys/vm/drop_caches", os.W_OK):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        left = resident(p)
    return left


def warm_memory(nbytes):
    """Touch then free `nbytes` of anonymous memory. On a virtual machine, memory a process touches
    for the first time (or again once the guest has handed freed pages back to the host) also faults
    on the host: measured here, the same read of 3.4 GB took 1.6 s, 3.5 s or 10.5 s in turn for that
    reason alone. Done before every timed load, so that each contender's memory comes in the same state."""
    m = mmap.mmap(-1, nbytes)
    np.frombuffer(m, dtype=np.uint8)[::4096] = 1
    m.close()


def touch_all(tree):
    """Read every byte of every tensor once (the max of its bytes: a vectorised pass on torch's threads
    that allocates nothing); returns the bytes."""
    n = 0
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.numel():
                v.detach().contiguous().view(-1).view(torch.uint8).max()  # every byte read
            n += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n


def write_all(tree):
    """Write every byte of every tensor once, in place (a uint8 view's `add_(0)`, on torch's threads), as a
    resumed training step does to the state it loaded: the optimizer updates its moments and the parameters
    in place. A load that maps the file pays for a private copy of each page there (copy-on-write)."""
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.numel():
                v.detach().view(-1).view(torch.uint8).add_(0)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def save_ours(tree, p):
    fr.save(tree, p)


def save_torch(tree, p):
    with open(p, "wb") as f:
        torch.save(tree, f)
        f.flush()
        os.fsync(f.fileno())


def load_torch(p):
    return torch.load(p, mmap=True, weights_only=True)


def save_st(tree, p):
    from safetensors.torch import save_file

    save_file(flat(tree), p)
    fsync_path(p)


def load_st(p):
    from safetensors.torch import load_file

    return load_file(p)


def st_reads_copies() -> bool:
    "Whether this safetensors can load into memory of its own (`backend='pread'`, safetensors 0.8)."
    import inspect

    from safetensors.torch import load_file

    return "backend" in inspect.signature(load_file).parameters


def load_st_pread(p):
    "safetensors' load into memory of its own: every tensor read with pread (not verified)."
    from safetensors.torch import load_file

    return load_file(p, backend="pread")


def save_raw(tree, p):
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in flat(tree).values():
            os.write(fd, t.contiguous().view(-1).view(torch.uint8).numpy().data) if t.numel() else None
        os.fsync(fd)
    finally:
        os.close(fd)


def touched(p):
    "A buffer of the file's size in anonymous memory, every page touched: what the limits read into."
    n = os.path.getsize(p)
    buf = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    buf.fill_(1)
    return buf


def fresh_memory(p, _):
    """No file: anonymous memory of the file's size, every byte written (torch's fill_, on its threads).
    What any load into memory of the process's own pays before it copies a byte; with the read of every
    tensor after it, the floor of such a load."""
    return torch.empty(os.path.getsize(p), dtype=torch.uint8).fill_(0)


def make_resident(p) -> float:
    """Bring the file's pages into the page cache (a buffered read of it all); returns the fraction
    resident. A "warm" load is timed on a file made so, whichever contender wrote it (this format's
    saves bypass the page cache, so their files are never warm by themselves)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = bytearray(16 << 20)
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    return resident(p)


def read_into(p, buf):
    "The file's bytes read() into `buf`, until every byte is in (one read() returns at most 2 GiB)."
    n = buf.numel()
    mv, done = memoryview(buf.numpy()), 0
    with open(p, "rb", buffering=0) as f:
        while done < n:
            got = f.readinto(mv[done:])
            if not got:
                raise OSError(f"{p}: short read at {done} of {n} bytes")
            done += got
    return buf


def copy_from_page_cache(p, buf):
    "The file mapped, then copied into `buf` by torch's copy_ (on its threads)."
    if buf.numel():
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf.copy_(torch.frombuffer(m, dtype=torch.uint8))
    return buf


OURS, OURS_MMAP, RAW = "fastai_resume", "fastai_resume mmap=True", "raw write"
ST, ST_PREAD, TORCH = "safetensors", "safetensors backend=pread", "torch.save/load(mmap)"
LIMIT_READ, LIMIT_COPY = "limit: read() into touched memory", "limit: copy from the page cache"
LIMIT_FRESH = "limit: fresh memory, no file"
RIVALS = (ST, ST_PREAD, TORCH, LIMIT_READ, LIMIT_COPY, LIMIT_FRESH)
# (name, save, [(load name, prepare or None, load)]): each load is timed on the file its save wrote;
# prepare(path) runs before the timer, and its result is load's second argument.
FORMATS = [
    (
        OURS,
        save_ours,
        [(OURS, None, lambda p, _: fr.load(p)), (OURS_MMAP, None, lambda p, _: fr.load(p, mmap=True))],
    ),
    (TORCH, save_torch, [(TORCH, None, lambda p, _: load_torch(p))]),
    (
        ST,
        save_st,
        [(ST, None, lambda p, _: load_st(p))]
        + ([(ST_PREAD, None, lambda p, _: load_st_pread(p))] if st_reads_copies() else []),
    ),
    (
        RAW,
        save_raw,
        [
            (LIMIT_READ, touched, read_into),
            (LIMIT_COPY, touched, copy_from_page_cache),
            (LIMIT_FRESH, None, fresh_memory),
        ],
    ),
]


def can_be_cold(d) -> bool:
    "Whether files in `d` can leave the page cache (not on tmpfs or ramfs, whose page cache is the storage)."
    return common.machine(d)["disk"]["fs"] not in ("tmpfs", "ramfs")


def run_dir(tree, d, rounds):
    """Every format's save and loads in `d`, in interleaved rounds: seconds and peak memory per
    round, and the fraction of the file in the page cache as each cold and each warm load began."""
    os.makedirs(d, exist_ok=True)
    caches = ("cold", "warm") if can_be_cold(d) else ("warm",)
    kinds = caches + ("write",)  # "write": warm, then every tensor written once instead of read
    res: dict = {}
    left, warm = [], []
    p = os.path.join(d, "ckpt")
    try:
        for r in range(rounds):
            for name, save, loads in FORMATS:
                if os.path.exists(p):
                    os.remove(p)
                gc.collect()
                with PeakRSS() as pk:
                    t0 = time.perf_counter()
                    save(tree, p)
                    ts = time.perf_counter() - t0
                res.setdefault(name, {}).setdefault("save", []).append(ts)
                res[name].setdefault("peak_extra", []).append(pk.extra)
                line = f"save {ts:5.2f}s"
                for lname, prepare, load in loads:
                    for cache in kinds:
                        if cache == "cold":
                            left.append(drop_cache(p))
                        else:
                            warm.append(make_resident(p))
                        gc.collect()
                        warm_memory(os.path.getsize(p))
                        pre = prepare(p) if prepare else None
                        t0 = time.perf_counter()
                        loaded = load(p, pre)
                        (write_all if cache == "write" else touch_all)(loaded)
                        tl = time.perf_counter() - t0
                        del loaded, pre
                        res.setdefault(lname, {}).setdefault(f"load_{cache}", []).append(tl)
                        line += f" | {lname} {cache} {tl:5.2f}s"
                os.remove(p)
                print(f"  {d} round {r}: {name}: {line}", flush=True)
    finally:
        if os.path.exists(p):
            os.remove(p)
    return res, kinds, left, warm


def paired(a, b):
    "The ratios a/b of two measurements' rounds, paired by round."
    return common.stats([x / y for x, y in zip(a, b)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dir",
        action="append",
        default=None,
        help="a folder to write in (repeatable); default: bench/results/io-tmp (disk) and /dev/shm (tmpfs)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="ViT-B/16 instead of ViT-L/16 (a quick check)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dirs = a.dir or [os.path.join(HERE, "results", "io-tmp"), f"/dev/shm/frk-io-{os.getpid()}"]
    tree = make_state(a.small)
    nbytes = touch_all(tree)
    print(f"state: {nbytes / 2**30:.2f} GiB ({'ViT-B/16' if a.small else 'ViT-L/16'} + Adam)")
    places = []
    for d in dirs:
        res, kinds, left, warm = run_dir(tree, d, a.rounds)
        rows = {name: {k: common.stats(v) for k, v in m.items()} for name, m in res.items()}
        ratios = {
            "save_over_raw_write": paired(res[OURS]["save"], res[RAW]["save"]),
            "load": {
                cache: {
                    ours: {
                        rival: paired(res[ours][f"load_{cache}"], res[rival][f"load_{cache}"])
                        for rival in RIVALS
                        if rival in res
                    }
                    for ours in (OURS, OURS_MMAP)
                }
                for cache in kinds
            },
        }
        reads = [c for c in kinds if c != "write"]  # the caches of the loads followed by a read
        place = {"dir": d, "disk": common.machine(d)["disk"], "caches": reads, "contenders": rows}
        place["ratios"] = ratios
        if LIMIT_FRESH in res:  # acquiring memory of its own, with no file, against safetensors' whole load
            place["floor"] = {c: paired(res[LIMIT_FRESH][f"load_{c}"], res[ST][f"load_{c}"]) for c in reads}
        if left:
            place["resident_when_cold"] = common.stats(left)
        place["resident_when_warm"] = common.stats(warm)
        places.append(place)
        if d.startswith("/dev/shm/"):
            shutil.rmtree(d, ignore_errors=True)
    payload = {
        "machine": common.machine(HERE),
        "rounds": a.rounds,
        "bytes": nbytes,
        "state": "ViT-B/16" if a.small else "ViT-L/16",
        "crc32c": fr._core.crc32c_impl,
        "places": places,
    }
    report.publish("io", payload, a.json)


if __name__ == "__main__":
    main()
