"""Checkpointing overhead on training: wall time of a fastai run with AutoCheckpoint saving in the
background and synchronously, against no checkpointing, at several save intervals, in interleaved
rounds (each round runs every configuration once, in turn, so that a change in the machine's load
falls on all of them), with medians and min-max over the rounds. The clocks start after the first
`--warm` steps (see `timed`) and stop when the fit has returned, a save still in flight written.

The process's CPU time (all its threads) is reported beside the wall time: on a machine shared with
other work, wall time mostly measures the others; CPU time measures the work a save adds.

Also, per save: the **stall** (how long the training loop was blocked by the save: building the
state tree, copying it, and waiting for a previous save still being written) against its limit,
a copy of the same number of bytes between two warm buffers (`memcpy`), measured in the same run;
each run's first save is reported apart (a background save allocates its reusable buffers then).

**Paired segments** (first, `--paired N`): whole-run wall times on a shared virtual machine move
by 20-50% from one run to the next, far more than a save costs. So one fit saves every 2N steps
and is cut into segments of N steps, a save in the middle of every other one; a save's cost is its
segment's time minus the mean of the two segments beside it (a second apart: the machine's drift
cancels). The same cut of a fit without saves gives the method's own noise, and background saves
written through the page cache (`AutoCheckpoint.saves.direct = False`) what writing around it saves,
background saves from snapshot buffers in 4 KB pages (`SnapshotPool(huge_pages=False)`) what the huge
pages save; a copy of the same number of bytes between two warm buffers at the same steps (`MemcpyAt`) is the
limit of any snapshot, measured where the snapshot runs. Each run's first save is reported apart (a background save allocates its reusable buffers then). The overhead at a save
interval of I steps is then cost / (I x step time).

Model: a frozen embedding table of 50,000 x 1,024 float32 (205 MB, a stand-in for a frozen
backbone) under a trainable MLP head trained with Adam: about 230 MB of checkpointed state and a
step of about 10 ms on 2 cores. Every save is fsynced. No interval but the shortest puts a save on
the last step (where the fit would wait for its write). The shortest interval asks for
saves faster than one can be written: at most one save is in flight, and a save that falls due
while the previous one is still being written waits for it (the wait is part of the stall).

    python bench/overhead.py [--paired 110] [--segments-saves 4] [--iters 600] [--warm 10]
                             [--every 250,110,10] [--rounds 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402
import fastai.callback.progress  # noqa: E402,F401  (Learner.no_bar)
import report  # noqa: E402
from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402

import fastai_resume  # noqa: E402
from fastai_resume.snapshot import SnapshotPool  # noqa: E402


def learner(path, iters, cbs):
    set_seed(0)
    bs = 32
    xs, ys = torch.randint(0, 50_000, (iters * bs,)), torch.randn(iters * bs, 1024)
    train = DataLoader(list(zip(xs, ys)), bs=bs, shuffle=True, drop_last=True)
    valid = DataLoader(list(zip(xs[:bs], ys[:bs])), bs=bs)
    emb = nn.Embedding(50_000, 1024)
    emb.weight.requires_grad_(False)
    model = nn.Sequential(emb, nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    return Learner(
        DataLoaders(train, valid, device="cpu", path=path),
        model,
        loss_func=nn.MSELoss(),
        path=path,
        cbs=cbs,
        train_bn=False,
    )


class TimedAutoCheckpoint(fastai_resume.AutoCheckpoint):
    "AutoCheckpoint recording, per save, how long it blocked training and how long its write took."

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.stalls, self.writes = [], []

    def _save(self, background=None):
        t0 = time.perf_counter()
        r = super()._save(background)
        dt = time.perf_counter() - t0
        if r is not None:
            self.stalls.append(dt)
        if not (self.background if background is None else background):
            self.writes.append(dt)
        return r

    def _check_inflight(self, block, last=False):
        w = self.saves.inflight.writer if self.saves.inflight is not None else None
        super()._check_inflight(block, last)
        if w is not None and self.saves.inflight is None:
            self.writes.append(w.seconds)


class Clock(Callback):
    "Starts the clocks once `warm` steps are trained: the model, its gradients and Adam's state exist."

    order = -100

    def __init__(self, warm):
        self.warm, self.t0 = warm, None

    def after_batch(self):
        if self.training and self.iter + 1 == self.warm:
            self.t0, self.c0 = time.perf_counter(), time.process_time()


class MemcpyAt(Callback):
    """The limit of a snapshot, inside the fit: at the steps where AutoCheckpoint would save, one copy
    of the same number of bytes (the model's and the optimizer's state) between two buffers already in
    memory, timed. The buffers are allocated at the first such step, as a background save's are."""

    order = 100  # where AutoCheckpoint runs

    def __init__(self, every):
        self.every, self.bufs, self.stalls = every, None, []

    def after_batch(self):
        if not self.training or self.learn.train_iter % self.every:
            return
        t0 = time.perf_counter()
        if self.bufs is None:
            n = state_bytes(self.learn)
            self.bufs = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        self.bufs[1].copy_(self.bufs[0])
        self.stalls.append(time.perf_counter() - t0)


def timed(path, iters, warm, cbs):
    """Wall and CPU seconds (all threads) of steps `warm`..`iters` of a fit, up to the end of the fit
    (AutoCheckpoint's `after_fit` waits for a save still being written). The first steps allocate the
    model's gradients and Adam's state: on a virtual machine, memory touched for the first time costs
    a fault on the host too, which varies from run to run and is not what the benchmark measures."""
    learn = learner(path, iters, cbs)
    clock = Clock(warm)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-4, cbs=clock)
        return time.perf_counter() - clock.t0, time.process_time() - clock.c0, learn


class StepTimes(Callback):
    "The time at the end of each training step, after AutoCheckpoint's (a save's stall is in its step)."

    order = 1000

    def before_fit(self):
        self.t = [time.perf_counter()]

    def after_batch(self):
        if self.training:
            self.t.append(time.perf_counter())


def paired(a, d):
    """Each save's cost against the segments beside it, over interleaved rounds of none / background
    / synchronous (see the module's docstring)."""
    n, saves, h = a.paired, a.segment_saves, a.paired // 2
    iters = 2 * n * saves + h + n + 1
    modes = ("none", "background", "synchronous", "background-buffered", "background-base-pages", "memcpy")
    cost = {m: [] for m in modes}
    first = {m: [] for m in modes}
    stalls = {m: [] for m in modes}
    step_s = []
    for r in range(a.rounds):
        for mode in modes:
            clock = StepTimes()
            cbs = [clock]
            if mode == "memcpy":
                cbs.append(MemcpyAt(2 * n))
            elif mode != "none":
                auto = TimedAutoCheckpoint(
                    every_iters=2 * n, every_epoch=False, keep=2, resume=False, background=mode != "synchronous"
                )
                auto.saves.direct = mode != "background-buffered"  # the comparison: through the page cache
                auto.saves.pool = SnapshotPool(huge_pages=mode != "background-base-pages")  # and: 4 KB pages
                cbs.append(auto)
            learn = learner(os.path.join(d, f"p{r}-{mode}"), iters, cbs)
            with learn.no_bar(), learn.no_logging():
                learn.fit(1, 1e-4)
            t = clock.t
            for j in range(1, saves + 1):
                s = 2 * n * j
                mid, prev, nxt = t[s + h] - t[s - h], t[s - h] - t[s - h - n], t[s + h + n] - t[s + h]
                (first if j == 1 else cost)[mode].append(mid - (prev + nxt) / 2)
            if mode == "none":
                step_s.append((t[-1] - t[n]) / (len(t) - 1 - n))
            else:
                stalls[mode].extend(cbs[1].stalls[1:])
            del learn
            print(
                f"  paired round {r}: {mode:12s} cost per save {1e3 * statistics.median(cost[mode][-(saves - 1) :]):+7.1f} ms",
                flush=True,
            )
    return {
        "segment_steps": n,
        "saves_per_run": saves,
        "step_s": common.stats(step_s),
        "cost_s": {m: common.stats(cost[m]) for m in modes},
        "first_cost_s": {m: common.stats(first[m]) for m in modes},
        "stall_s": {m: common.stats(stalls[m]) for m in modes if m != "none"},
    }


def state_bytes(learn):
    opt = sum(
        t.numel() * t.element_size()
        for st in learn.opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    return sum(v.numel() * v.element_size() for v in learn.model.state_dict().values()) + opt


def memcpy_seconds(nbytes, reps=3):
    "The limit of a snapshot: one copy of `nbytes` between two buffers already in memory."
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--paired", type=int, default=110, help="segment length in steps of the paired measurement (0: skip)"
    )
    ap.add_argument("--segment-saves", type=int, default=4, help="saves per run of the paired measurement")
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--warm", type=int, default=10, help="steps before the clocks start")
    ap.add_argument("--every", default="250,110,10", help="save intervals in steps, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own choice)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    intervals = [int(x) for x in a.every.split(",")]
    info = common.machine(HERE)
    runs = {"none": []}
    cpu = {"none": []}
    for e in intervals:
        runs[f"background/{e}"], runs[f"synchronous/{e}"] = [], []
        cpu[f"background/{e}"], cpu[f"synchronous/{e}"] = [], []
    stalls = {k: [] for k in runs}  # every save but each run's first
    first = {k: [] for k in runs}  # each run's first save: the snapshot buffers are allocated then
    writes = {k: [] for k in runs}
    memcpy, nbytes, step_s = [], None, []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=HERE) as d:
        pair = paired(a, d) if a.paired else None
        for r in range(a.rounds):
            for name in runs:
                cbs = []
                if name != "none":
                    mode, e = name.split("/")
                    cbs = [
                        TimedAutoCheckpoint(
                            every_iters=int(e), every_epoch=False, keep=2, resume=False, background=mode == "background"
                        )
                    ]
                t, c, learn = timed(os.path.join(d, f"{r}-{name.replace('/', '-')}"), a.iters, a.warm, cbs)
                runs[name].append(t)
                cpu[name].append(c)
                if cbs:
                    first[name].append(cbs[0].stalls[0])
                    stalls[name].extend(cbs[0].stalls[1:])
                    writes[name].extend(cbs[0].writes)
                else:
                    step_s.append(t / (a.iters - a.warm))
                if nbytes is None:
                    nbytes = state_bytes(learn)
                del learn
                print(
                    f"  round {r}: {name:16s} {t:7.2f} s"
                    + (f"  stall per save {1e3 * statistics.median(cbs[0].stalls):6.1f} ms" if cbs else ""),
                    flush=True,
                )
            memcpy.append(memcpy_seconds(nbytes))
    rows = []
    for e in intervals:
        row = {"every": e, "saves": a.iters // e}
        for mode in ("background", "synchronous"):
            k = f"{mode}/{e}"
            over = [100 * (t / n - 1) for t, n in zip(runs[k], runs["none"])]  # paired with its round's run
            over_cpu = [100 * (t / n - 1) for t, n in zip(cpu[k], cpu["none"])]
            row[mode] = {
                "wall_s": common.stats(runs[k]),
                "overhead_pct": common.stats(over),
                "cpu_s": common.stats(cpu[k]),
                "cpu_overhead_pct": common.stats(over_cpu),
                "stall_s": common.stats(stalls[k]),
                "first_stall_s": common.stats(first[k]),
                "write_s": common.stats(writes[k]),
            }
        row["interval_s"] = statistics.median(step_s) * e
        rows.append(row)
    payload = {
        "machine": info,
        "rounds": a.rounds,
        "iters": a.iters,
        "state_bytes": nbytes,
        "step_s": common.stats(step_s),
        "none_wall_s": common.stats(runs["none"]),
        "none_cpu_s": common.stats(cpu["none"]),
        "memcpy_s": common.stats(memcpy),
        "rows": rows,
        "paired": pair,
        "bench_seconds": time.perf_counter() - t_start,
    }
    print(
        f"\n{a.iters} steps of {1e3 * statistics.median(step_s):.0f} ms (median), saves of {nbytes / 1e6:.0f} MB, "
        f"{a.rounds} rounds; memcpy of the same bytes {1e3 * statistics.median(memcpy):.0f} ms"
    )
    report.publish("overhead", payload, a.json)


if __name__ == "__main__":
    main()
