"""Checkpointing overhead on training: wall time of a fastai run with AutoCheckpoint every 50
iterations, with background saves and with synchronous saves, against no checkpointing, in one run.

Model: a frozen embedding table of 50,000 x 1,024 float32 (205 MB, a stand-in for a frozen
backbone) under a trainable MLP head trained with Adam: about 230 MB of checkpointed state and a
step of tens of milliseconds on this machine's CPU. (A model whose 200 MB are all trained cannot
step in tens of ms here: Adam's update alone over 200 MB takes about 0.2 s on this machine's
memory bandwidth.) Every save is fsynced.
Prints a table, writes JSON (bench/results/overhead.json).

    python bench/overhead.py [--iters 300] [--every 50] [--rounds 2]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fastai_resume  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402


def learner(path, iters, cbs):
    set_seed(0)
    bs = 32
    xs, ys = torch.randint(0, 50_000, (iters * bs,)), torch.randn(iters * bs, 1024)
    train = DataLoader(list(zip(xs, ys)), bs=bs, shuffle=True, drop_last=True)
    valid = DataLoader(list(zip(xs[:bs], ys[:bs])), bs=bs)
    emb = nn.Embedding(50_000, 1024)
    emb.weight.requires_grad_(False)
    model = nn.Sequential(emb, nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    return Learner(DataLoaders(train, valid, device="cpu", path=path), model, loss_func=nn.MSELoss(), path=path,
                   cbs=cbs, train_bn=False)


def timed(path, iters, cbs):
    learn = learner(path, iters, cbs)
    with learn.no_bar(), learn.no_logging():
        t0 = time.perf_counter()
        learn.fit(1, 1e-4)
        return time.perf_counter() - t0, learn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.json"))
    a = ap.parse_args()
    configs = {"no checkpointing": lambda: [],
               "AutoCheckpoint, background": lambda: [fastai_resume.AutoCheckpoint(every_iters=a.every, every_epoch=False, keep=2, resume=False)],
               "AutoCheckpoint, synchronous": lambda: [fastai_resume.AutoCheckpoint(every_iters=a.every, every_epoch=False, keep=2, resume=False, background=False)]}
    times = {k: [] for k in configs}
    state_mb = None
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(__file__))) as d:
        for r in range(a.rounds):
            for name, make in configs.items():
                t, learn = timed(os.path.join(d, f"{r}-{len(times[name])}-{name[:4]}"), a.iters, make())
                times[name].append(t)
                if state_mb is None:
                    opt_bytes = sum(t.numel() * t.element_size() for st in learn.opt.state.values()
                                    for t in st.values() if isinstance(t, torch.Tensor))
                    state_mb = (sum(v.numel() * v.element_size() for v in learn.model.state_dict().values()) + opt_bytes) / 1e6
                print(f"  round {r}: {name:28s} {t:7.2f}s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    base = best["no checkpointing"]
    n_saves = a.iters // a.every
    print(f"\n{a.iters} iterations, {n_saves} saves of ~{state_mb:.0f} MB (model and Adam state), "
          f"{base / a.iters * 1e3:.0f} ms per step")
    print("| run | wall time | overhead vs none |")
    print("|---|---|---|")
    for k, t in best.items(): print(f"| {k} | {t:.2f} s | {100 * (t / base - 1):+.1f}% |")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"iters": a.iters, "every": a.every, "state_mb": state_mb, "times": times, "best": best}, f, indent=1)
    print(f"\nwrote {a.json} (best of {a.rounds} rounds)")


if __name__ == "__main__":
    main()
