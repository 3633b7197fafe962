"""Resume-time benchmark: time from calling `fit` to the first trained batch when resuming at
k = 0, 50% and 90% of an epoch of 20,000 batches whose items cost about 0.2 ms each to load.

Contenders, in the same run: fastai_resume (a real checkpoint saved at iteration k, loaded by a
fresh learner; the skip happens on the index list) and the seed PR's approach (fastai #4020: a
callback that raises CancelBatchException in before_batch until iteration k, so every skipped
batch is still loaded and collated). Interleaved rounds (each round runs both contenders at every k),
medians with min-max over the rounds. Prints a table, writes JSON (bench/results/resume.json).

    python bench/resume.py [--batches 20000] [--item-ms 0.2] [--rounds 5]
"""

import argparse
import os
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
from fastai.callback.core import Callback, CancelBatchException, CancelFitException  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402

import fastai_resume  # noqa: E402,F401


class SlowItem:
    "A per-item cost like decoding an image or tokenising a document."

    def __init__(self, ms):
        self.s = ms / 1000

    def __call__(self, item):
        end = time.perf_counter() + self.s
        while time.perf_counter() < end:
            pass
        return item


def build(path, n, ms):
    set_seed(0)
    xs = torch.randn(n, 8)
    items = list(zip(xs, xs.sum(1, keepdim=True)))
    train = DataLoader(items, bs=1, shuffle=True, after_item=SlowItem(ms))
    valid = DataLoader(items[:64], bs=64)
    return Learner(
        DataLoaders(train, valid, device="cpu", path=path), nn.Linear(8, 1), loss_func=nn.MSELoss(), path=path
    )


class SaveAt(Callback):
    order = 100

    def __init__(self, k):
        self.k = k

    def after_batch(self):
        if self.training and self.iter + 1 == self.k:
            self.learn.save("bench", with_iter=True)
            raise CancelFitException()


class FirstTrainedBatch(Callback):
    "Records when the first batch that is really trained starts, then stops the fit."

    order = 1000

    def before_batch(self):
        if self.training:
            self.t = time.perf_counter()
            raise CancelFitException()


class SeedSkipToIter(Callback):
    "The seed PR's approach: cancel batches until the saved iteration (each one still loaded)."

    order = 70

    def __init__(self, epoch, it):
        self.e, self.i = epoch, it

    def before_batch(self):
        if self.training and self.epoch == self.e and self.iter < self.i:
            raise CancelBatchException()


def save_at(path, n, ms, k):
    "A real checkpoint of a fit stopped after k batches (saved as `bench`)."
    learn = build(path, n, ms)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=SaveAt(k))


def ours(path, n, ms, k):
    "One resume by a fresh learner: (seconds from `fit` to the first trained batch, seconds of `learn.load`)."
    learn = build(path, n, ms)
    t_load = 0.0
    if k:
        t0 = time.perf_counter()
        learn.load("bench")
        t_load = time.perf_counter() - t0
    probe = FirstTrainedBatch()
    t0 = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=probe)
    return probe.t - t0, t_load


def seed(path, n, ms, k):
    learn = build(path, n, ms)
    probe = FirstTrainedBatch()
    t0 = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=[SeedSkipToIter(0, k), probe])
    return probe.t - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--item-ms", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    fracs = (0.0, 0.5, 0.9)
    ks = [int(a.batches * f) for f in fracs]
    runs = {k: {"ours_s": [], "ours_load_s": [], "seed_s": []} for k in ks}
    machine = common.machine(HERE)
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):  # interleaved: each round runs every contender at every k, in turn
            for k in ks:
                path = os.path.join(d, str(k))
                if r == 0 and k:
                    save_at(path, a.batches, a.item_ms, k)
                t_ours, t_load = ours(path, a.batches, a.item_ms, k)
                t_seed = seed(path, a.batches, a.item_ms, k)
                for key, v in (("ours_s", t_ours), ("ours_load_s", t_load), ("seed_s", t_seed)):
                    runs[k][key].append(v)
                print(
                    f"  round {r} k={k:6d}: ours {t_ours * 1e3:8.1f} ms (load {t_load * 1e3:.1f} ms)  "
                    f"seed PR {t_seed * 1e3:9.1f} ms",
                    flush=True,
                )
    k0 = runs[0]["ours_s"]
    rows = []
    for f, k in zip(fracs, ks):
        m = runs[k]
        rows.append(
            {
                "k": k,
                "fraction": f,
                **{key: common.stats(v) for key, v in m.items()},
                # paired by round: the same round's runs met the same load
                "seed_over_ours": common.stats([x / y for x, y in zip(m["seed_s"], m["ours_s"])]),
                "ours_over_k0": common.stats([x / y for x, y in zip(m["ours_s"], k0)]),
            }
        )
    payload = {"machine": machine, "rounds": a.rounds, "batches": a.batches, "item_ms": a.item_ms, "rows": rows}
    report.publish("resume", payload, a.json)


if __name__ == "__main__":
    main()
