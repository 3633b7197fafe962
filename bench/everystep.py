"""A checkpoint at every optimizer step of a LoRA fine-tune: what it adds to the mean step time.

The run is a user's: a GPT-2-shaped model (8 layers, 512 wide, GPT-2's 50,257-token vocabulary, random
weights from its config) written with `save_pretrained` and loaded with `from_pretrained`, LoRA r=8 on
`c_attn` from `peft`, fastai's Hugging Face tutorial recipe (`Learner`, `LMDataLoader`, `DropOutput`),
`fit`. Each contender is a new process training the same batches from the same seed:

- `none`: no checkpoint;
- `every 1` / `every 10`: `AutoCheckpoint(every_iters=1 or 10)` with its default saves (`background='auto'`:
  a checkpoint this small is written at the batch boundary, synced and put in place by a thread);
- `every 1 sync` / `every 10 sync`: `background=False` (written around the page cache, synced, in place at
  the boundary).

A step's time is the time from one training batch's start to the next's (everything the callbacks do
after it included); the first `--warmup` steps of each process are left out (the first save allocates
its buffers). Also measured in the same processes: the time from the callbacks before AutoCheckpoint's at
each batch's end to the next batch's start, less the same in the same round's run without checkpoints
(the save's own time at the training thread: what the machine's noise, several percent from one process
to the next on this shared machine, does not blur; a thread's competition for the cores and the caches a
save evicts are only in the step). Contenders interleaved, `--rounds` rounds; each figure is the median
of the rounds' means, and the overhead is paired by round (a contender's mean step against the same
round's `none`).

    python bench/everystep.py [--rounds 5] [--steps 40]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
import common  # noqa: E402
import llm  # noqa: E402  (the tutorial's learner)

CONTENDERS = {
    "none": None,
    "every 1": dict(every_iters=1),
    "every 1 sync": dict(every_iters=1, background=False),
    "every 10": dict(every_iters=10),
    "every 10 sync": dict(every_iters=10, background=False),
}


def one_run(a):
    "One contender in this (new) process: prints its step times as JSON."
    import torch
    from fastai.callback.core import Callback
    from fastai.torch_core import set_seed

    import fastai_resume as fr

    settings = CONTENDERS[a.run]
    set_seed(0)
    work = tempfile.mkdtemp(prefix="run-", dir=a.work)
    learn = llm.learner(os.path.join(a.work, "base"), work, a.bs, a.seq_len, a.steps, valid_batches=1)
    starts: list = []

    class Clock(Callback):
        order = -1000  # first at each batch's start: the step before it has done everything, saves included

        def before_batch(self):
            if self.training:
                starts.append(time.perf_counter())
                if ends:
                    stalls.append(starts[-1] - ends[-1])

        def after_train(self):
            starts.append(time.perf_counter())
            stalls.append(starts[-1] - ends[-1])

    stalls: list = []  # from the callbacks before AutoCheckpoint's (order 100) at a batch's end to the next start
    ends: list = []

    class Before(Callback):
        order = 99.5  # (a save completes the event's later callbacks first: measured to the next batch's start)

        def after_batch(self):
            if self.training:
                ends.append(time.perf_counter())

    cbs = [Clock(), Before()]
    if settings is not None:
        cbs.append(fr.AutoCheckpoint(every_epoch=False, **settings))
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=cbs)
    steps = [b - a_ for a_, b in zip(starts, starts[1:])][a.warmup :]
    saved = len(os.listdir(os.path.join(work, "models"))) if settings else 0
    shutil.rmtree(work, ignore_errors=True)
    out = {"steps": steps, "tails": stalls[a.warmup :], "threads": torch.get_num_threads(), "files": saved}
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--only", default=None, help="comma-separated contenders (default: all)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the disk)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # (one contender's new process)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        return one_run(a)

    from transformers import GPT2Config, GPT2LMHeadModel

    names = a.only.split(",") if a.only else list(CONTENDERS)
    work = tempfile.mkdtemp(prefix="frk-every-", dir=a.dir or os.path.join(HERE, ".."))
    try:
        cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=a.width // 64)
        GPT2LMHeadModel(cfg).save_pretrained(os.path.join(work, "base"))
        means: dict = {k: [] for k in names}
        stalls: dict = {k: [] for k in names}
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                cmd = [sys.executable, __file__, "--run", name, "--work", work]
                cmd += ["--steps", str(a.steps), "--warmup", str(a.warmup)]
                cmd += ["--bs", str(a.bs), "--seq-len", str(a.seq_len)]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode:
                    sys.exit(p.stdout + p.stderr)
                got = json.loads(p.stdout.strip().splitlines()[-1])
                means[name].append(statistics.fmean(got["steps"]))
                stalls[name].append(statistics.fmean(got["tails"]))
                print(
                    f"round {r} {name:>14}: {1e3 * means[name][-1]:.1f} ms a step, "
                    f"{1e3 * stalls[name][-1]:.2f} ms of it at the batch's end from AutoCheckpoint's order on",
                    flush=True,
                )
        machine = common.machine(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = means.get("none")
    added = {
        k: common.stats([100 * (m / b - 1) for m, b in zip(v, base)]) for k, v in means.items() if base and k != "none"
    }
    import report

    report.publish(
        "everystep",
        {
            "machine": machine,
            "rounds": a.rounds,
            "steps": a.steps,
            "warmup": a.warmup,
            "model": f"GPT-2-shaped ({a.layers} layers, {a.width} wide), LoRA r=8 on c_attn, bs {a.bs} x {a.seq_len}",
            "step_s": {k: common.stats(v) for k, v in means.items()},
            "added_pct": added,
            "tail_s": {k: common.stats(v) for k, v in stalls.items()},
            "stall_s": {  # the save's own time at the boundary: the tail, less the same round's without a save
                k: common.stats([x - n for x, n in zip(v, stalls["none"])]) for k, v in stalls.items() if k != "none"
            }
            if "none" in stalls
            else {},
            "stall_pct": {
                k: common.stats([100 * (x - n) / b for x, n, b in zip(v, stalls["none"], base)])
                for k, v in stalls.items()
                if base and k != "none"
            },
        },
    )


if __name__ == "__main__":
    main()
