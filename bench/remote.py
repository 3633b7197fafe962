"""What mirroring checkpoints to object storage costs training, and how long a resume from the remote takes
against a resume from the local disk, on a local S3-API server (moto's, its own process, over HTTP through
s3fs: tests/s3server.py). The server runs on the same cores as training here: what it spends serving the
uploads is counted against training too, which a bucket elsewhere would not cost: it runs at the lowest
priority (`--server-nice 19`), so that it takes what training leaves, as far as the scheduler allows.

**Training overhead.** In interleaved rounds, one fit with `AutoCheckpoint(background=True)` saving every
`--every` steps, without and with `remote=`: the whole run's wall and CPU time (steps `--warm`.. to the end
of the fit), paired with its round's run without a remote. And, paired within a run as bench/overhead.py
pairs a save with the segments beside it: each upload's cost is the time of the steps trained while it ran
minus as many steps of the time beside it (the same duration before it started and after it ended); the
mirror's overhead is the sum of those costs over the run's time. The run's last upload (after the fit) is
waited for between runs, outside the clocks.

**Resume.** The newest checkpoint of the last round, loaded into a new learner from the local folder
(`learn.load(path)`: read, verified, restored) and from the remote into an empty folder
(`learn.load('s3://...')`: streamed download, CRC32C against its marker, then the same load), and the
download alone (`Mirror.resume_point`, what autoresume does on a new machine); medians of `--rounds`.

    python bench/remote.py [--emb 12000] [--iters 1200] [--every 400] [--warm 10] [--rounds 3] [--server-nice 19]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE, os.path.join(HERE, "..", "tests")]
import common  # noqa: E402
import fastai.callback.progress  # noqa: E402,F401  (Learner.no_bar)
from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402
from s3server import Server  # noqa: E402

import fastai_resume  # noqa: E402
from fastai_resume import objstore, remote  # noqa: E402


def learner(path, iters, emb, cbs=()):
    "bench/overhead.py's model with a smaller frozen table (`emb` rows of 1,024): a checkpoint the server takes in seconds."
    set_seed(0)
    bs = 32
    xs, ys = torch.randint(0, emb, (iters * bs,)), torch.randn(iters * bs, 1024)
    train = DataLoader(list(zip(xs, ys)), bs=bs, shuffle=True, drop_last=True)
    valid = DataLoader(list(zip(xs[:bs], ys[:bs])), bs=bs)
    table = nn.Embedding(emb, 1024)
    table.weight.requires_grad_(False)
    model = nn.Sequential(table, nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    dls = DataLoaders(train, valid, device="cpu", path=path)
    return Learner(dls, model, loss_func=nn.MSELoss(), path=path, cbs=list(cbs), train_bn=False)


class StepTimes(Callback):
    "The time at the end of each training step, and the clocks from step `warm` on."

    order = 1000

    def __init__(self, warm):
        self.warm, self.t = warm, []

    def after_batch(self):
        if self.training:
            self.t.append(time.perf_counter())
            if len(self.t) == self.warm:
                self.t0, self.c0 = time.perf_counter(), time.process_time()


WINDOWS: list = []  # (start, end) of each upload of the current run
_mirror = remote.Mirror._mirror


def _timed_mirror(self, path):
    t0 = time.perf_counter()
    try:
        return _mirror(self, path)
    finally:
        WINDOWS.append((t0, time.perf_counter()))


remote.Mirror._mirror = _timed_mirror  # the bench's clock around each upload (its checks and marker included)


def upload_costs(t, windows) -> list:
    """Each upload's cost to training: the steps that ended while it ran, minus as many steps at the mean
    step time of the same duration just before it and just after it (steps of other uploads excluded)."""
    steps = [(t[i - 1], t[i]) for i in range(1, len(t))]

    def inside(a, b):
        return [e - s for s, e in steps if a <= e < b]

    out = []
    for k, (a, b) in enumerate(windows):
        during = inside(a, b)
        if len(during) < 3:
            continue
        lo = windows[k - 1][1] if k else -1.0
        hi = windows[k + 1][0] if k + 1 < len(windows) else float("inf")
        beside = inside(max(lo, a - (b - a)), a) + inside(b, min(hi, b + (b - a)))
        if len(beside) < 3:
            continue
        out.append(sum(during) - len(during) * statistics.mean(beside))
    return out


def fit(path, a, url=None):
    "One timed fit; with `url`, mirrored there. Returns (wall s, cpu s, upload costs, upload seconds, mirror)."
    clock = StepTimes(a.warm)
    kw = dict(remote=url) if url else {}
    auto = fastai_resume.AutoCheckpoint(every_iters=a.every, every_epoch=False, keep=2, resume=False, **kw)
    learn = learner(path, a.iters, a.emb, [auto])
    WINDOWS.clear()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-4, cbs=clock)
    wall, cpu = time.perf_counter() - clock.t0, time.process_time() - clock.c0
    m = auto._mirror
    if m is not None:
        m.close()  # the last upload, outside the clocks, before the next run
    costs = upload_costs(clock.t, [w for w in WINDOWS if w[1] <= clock.t[-1]])
    return wall, cpu, costs, [b - s for s, b in WINDOWS], m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb", type=int, default=12000, help="rows of the frozen table (1,024 float32 each)")
    ap.add_argument("--iters", type=int, default=1200)
    ap.add_argument("--every", type=int, default=400, help="save interval in steps")
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--server-nice",
        type=int,
        default=19,
        help="the S3 server's niceness (a bucket elsewhere costs these cores nothing)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    info = common.machine(HERE)
    server = Server(nice=a.server_nice)
    os.environ.update(server.env())
    objstore.filesystem("s3://bench/")[0].mkdir("bench")
    t_start = time.perf_counter()
    wall = {"local": [], "remote": []}
    cpu = {"local": [], "remote": []}
    costs, uploads, step_s = [], [], []
    with tempfile.TemporaryDirectory(dir=HERE) as d:
        for r in range(a.rounds):
            for mode in ("local", "remote"):
                url = f"s3://bench/round{r}/" if mode == "remote" else None
                w, c, cost, up, m = fit(os.path.join(d, f"{r}-{mode}"), a, url)
                wall[mode].append(w)
                cpu[mode].append(c)
                if mode == "local":
                    step_s.append(w / (a.iters - a.warm))
                else:
                    costs.extend(cost)
                    uploads.extend(up)
                    last = m
                print(f"  round {r}: {mode:6s} {w:7.2f} s wall, {c:7.2f} s cpu", flush=True)
        # resume: the newest checkpoint of the last round, from the local folder and from the remote
        name = last.newest
        local = os.path.join(d, f"{a.rounds - 1}-remote", "models", name)
        nbytes = os.path.getsize(local)
        t_local, t_remote, t_download = [], [], []
        for r in range(a.rounds):
            learn = learner(os.path.join(d, f"l{r}"), a.iters, a.emb)
            t0 = time.perf_counter()
            learn.load(local)
            t_local.append(time.perf_counter() - t0)
            learn = learner(os.path.join(d, f"r{r}"), a.iters, a.emb)
            t0 = time.perf_counter()
            learn.load(last.url + name)
            t_remote.append(time.perf_counter() - t0)
            empty = os.path.join(d, f"m{r}")
            os.makedirs(empty)
            m = remote.Mirror(last.url, None, empty, *name.split("-")[:2], 2, 60)
            t0 = time.perf_counter()
            got = m.resume_point(None)
            t_download.append(time.perf_counter() - t0)
            assert got is not None and got.name == name
            shutil.rmtree(empty)
    server.stop()
    run_s = statistics.median(wall["remote"])
    over = [100 * (x / y - 1) for x, y in zip(wall["remote"], wall["local"])]
    over_cpu = [100 * (x / y - 1) for x, y in zip(cpu["remote"], cpu["local"])]
    saves = a.iters // a.every
    payload = {
        "machine": info,
        "rounds": a.rounds,
        "server_nice": a.server_nice,
        "iters": a.iters,
        "every": a.every,
        "checkpoint_bytes": nbytes,
        "step_s": common.stats(step_s),
        "wall_s": {k: common.stats(v) for k, v in wall.items()},
        "cpu_s": {k: common.stats(v) for k, v in cpu.items()},
        "overhead_pct": common.stats(over),
        "cpu_overhead_pct": common.stats(over_cpu),
        "upload_s": common.stats(uploads),
        "upload_cost_s": common.stats(costs) if costs else None,
        "paired_overhead_pct": 100 * statistics.median(costs) * saves / run_s if costs else None,
        "resume_local_s": common.stats(t_local),
        "resume_remote_s": common.stats(t_remote),
        "download_s": common.stats(t_download),
        "bench_seconds": time.perf_counter() - t_start,
    }
    path = common.write("remote", payload, a.json)
    med = statistics.median
    print(
        f"\n{a.iters} steps of {1e3 * med(step_s):.0f} ms, a {nbytes / 1e6:.0f} MB checkpoint every {a.every} steps "
        f"({a.every * med(step_s):.0f} s), {a.rounds} rounds, the S3 server (moto) on the same {os.cpu_count()} cores "
        f"at nice {a.server_nice}"
    )
    print(f"{'':38s} {'median':>10s} {'min':>10s} {'max':>10s}")
    rows = [
        ("run, background saves, no remote (s)", wall["local"]),
        ("run, background saves + remote (s)", wall["remote"]),
        ("overhead of the mirror, whole run (%)", over),
        ("CPU overhead, whole run (%)", over_cpu),
        ("one upload, checked, marker (s)", uploads),
        ("its cost to training, paired (s)", costs or [float("nan")]),
        ("resume from the local disk (s)", t_local),
        ("resume from the remote, load(URL) (s)", t_remote),
        ("download alone, autoresume's (s)", t_download),
    ]
    for label, v in rows:
        print(f"{label:38s} {med(v):10.3f} {min(v):10.3f} {max(v):10.3f}")
    if costs:
        print(f"paired overhead of the mirror at this interval: {payload['paired_overhead_pct']:.1f}% of the run")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
