"""Checkpoint I/O benchmark: this format against torch.save/torch.load(mmap), safetensors and a raw
write/read of the same bytes, in one run, on the disk and on tmpfs, with fsync for every contender,
in interleaved rounds (medians with min-max; the ratio to the raw write and read is paired by round).

State: torchvision's ViT-L/16 (about 1.1 GiB of float32 parameters, randomly initialised: nothing
is downloaded) plus Adam's two moment buffers. Save = serialise + write + fsync. Load = open and
read every tensor once, after the file's pages were dropped from the page cache (fadvise), so
every contender reads from the disk, and after as much memory as the file was touched and freed
(`warm_memory`: a virtual machine's host faults otherwise decide the result). The raw read is
read() into anonymous memory, the kind `fastai_resume.load` reads into. Prints a table, writes JSON (bench/results/io.json).

    python bench/io.py [--dir DIR ...] [--rounds 5] [--small]
"""

import argparse
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


def drop_cache(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_memory(nbytes):
    """Touch then free `nbytes` of anonymous memory. On a virtual machine, memory a process touches
    for the first time (or again once the guest has handed freed pages back to the host) also faults
    on the host: measured here, the same read of 3.4 GB took 1.6 s, 3.5 s or 10.5 s in turn for that
    reason alone. Done before every timed load, so that each contender's memory comes in the same state."""
    m = mmap.mmap(-1, nbytes)
    np.frombuffer(m, dtype=np.uint8)[::4096] = 1
    m.close()


def touch_all(tree):
    "Read every tensor once (a sum over its bytes), as training would."
    n = 0
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.numel():
                v.view(-1)[:: max(1, 4096 // v.element_size())].sum()  # one read per page
            n += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n


def save_ours(tree, p):
    fr.save(tree, p)


def load_ours(p):
    return fr.load(p)


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


def save_raw(tree, p):
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in flat(tree).values():
            os.write(fd, t.contiguous().view(-1).view(torch.uint8).numpy().data) if t.numel() else None
        os.fsync(fd)
    finally:
        os.close(fd)


def load_raw(p):
    """The file's bytes into memory of the process's own, of the kind `fastai_resume.load` reads into
    (anonymous pages from mmap): read() until every byte is in (one read() returns at most 2 GiB)."""
    n = os.path.getsize(p)
    buf = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    mv, done = memoryview(buf.numpy()), 0
    with open(p, "rb", buffering=0) as f:
        while done < n:
            got = f.readinto(mv[done:])
            if not got:
                raise OSError(f"{p}: short read at {done} of {n} bytes")
            done += got
    return buf


CONTENDERS = [
    ("fastai_resume", save_ours, load_ours),
    ("torch.save/load(mmap)", save_torch, load_torch),
    ("safetensors", save_st, load_st),
    ("raw write/read", save_raw, load_raw),
]


def run_dir(tree, nbytes, d, rounds):
    "Every contender's save and load in `d`, in interleaved rounds: seconds and peak memory per round."
    os.makedirs(d, exist_ok=True)
    res = {name: {"save": [], "load": [], "peak_extra": []} for name, _, _ in CONTENDERS}
    p = os.path.join(d, "ckpt")
    try:
        for r in range(rounds):
            for name, save, load in CONTENDERS:
                if os.path.exists(p):
                    os.remove(p)
                gc.collect()
                with PeakRSS() as pk:
                    t0 = time.perf_counter()
                    save(tree, p)
                    ts = time.perf_counter() - t0
                drop_cache(p)
                gc.collect()
                warm_memory(os.path.getsize(p))
                t0 = time.perf_counter()
                loaded = load(p)
                touch_all(loaded)
                tl = time.perf_counter() - t0
                del loaded
                res[name]["save"].append(ts)
                res[name]["load"].append(tl)
                res[name]["peak_extra"].append(pk.extra)
                os.remove(p)
                print(
                    f"  {d} round {r}: {name:24s} save {ts:7.2f}s  load {tl:7.2f}s  peak +{pk.extra / 2**20:7.0f} MiB",
                    flush=True,
                )
    finally:
        if os.path.exists(p):
            os.remove(p)
    return res


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
        res = run_dir(tree, nbytes, d, a.rounds)
        rows = {name: {k: common.stats(v) for k, v in m.items()} for name, m in res.items()}
        ours, raw = res["fastai_resume"], res["raw write/read"]
        ratio = {k: common.stats([x / y for x, y in zip(ours[k], raw[k])]) for k in ("save", "load")}  # paired by round
        places.append({"dir": d, "disk": common.machine(d)["disk"], "contenders": rows, "ours_over_raw": ratio})
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
    path = common.write("io", payload, a.json)
    print(report.render_file("io", path))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
