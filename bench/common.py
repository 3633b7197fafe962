"""What every benchmark writes with its figures: the statistics of its rounds (median, min, max)
and a description of the machine it ran on, into one JSON file per benchmark under bench/results/
(which `python bench/report.py` turns into the README's tables)."""

import datetime
import json
import os
import platform
import statistics
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def stats(values) -> dict:
    "Median, min and max of one measurement over rounds, with the values themselves."
    values = [float(v) for v in values]
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def _disk(path):
    "The file system and block device holding `path`, and whether the kernel calls it rotational."
    path = os.path.realpath(path)
    best = ("?", "?", "/")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                best = (dev, fs, mnt)
    dev, fs, mnt = best
    out = {"path": path, "device": dev, "fs": fs, "mount": mnt}
    name = os.path.basename(dev)
    rot = f"/sys/block/{name}/queue/rotational"
    if os.path.exists(rot):
        with open(rot) as f:
            out["rotational"] = f.read().strip() == "1"
    return out


def machine(data_dir=RESULTS) -> dict:
    "Cores, CPU, memory, the disk the benchmark wrote to, the date, and how loaded the machine was."
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem / 2**30, 1),
        "disk": _disk(data_dir),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def write(name: str, payload: dict, path=None) -> str:
    "Write `payload` (plus the command that made it) as bench/results/NAME.json; returns the path."
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {
        "benchmark": name,
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        **payload,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


class RankTimes:
    """The contenders' times on this rank of a torch.distributed job, every rank starting each one together (a
    barrier first); `slowest()`: per contender and round, the slowest rank's time (what the job waits for)."""

    def __init__(self, keys):
        self.times: dict = {k: [] for k in keys}

    def timed(self, key, f):
        import time

        import torch.distributed as D

        D.barrier()
        t0 = time.perf_counter()
        f()
        self.times[key].append(time.perf_counter() - t0)

    def slowest(self) -> dict:
        "On every rank: {contender: [the slowest rank's seconds, per round]} (a collective)."
        from fastai_resume import dist

        keys = sorted(self.times)
        rounds = len(self.times[keys[0]])
        mine = [int(x * 1e9) for k in keys for x in self.times[k]]
        every = dist.all_gather_ints("bench: times", mine)
        return {k: [max(r[i * rounds + j] for r in every) / 1e9 for j in range(rounds)] for i, k in enumerate(keys)}


def torchrun_worker(script: str, n: int, args: list, out: str) -> dict:
    """`script --worker ARGS` as an `n`-process torchrun job (one thread each, warnings off); the JSON it wrote
    to `out`. A failed job ends the benchmark with its output."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd + ["--worker", "--out", out, *args], capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(p.stdout[-3000:] + p.stderr[-5000:])
    with open(out) as f:
        return json.load(f)
