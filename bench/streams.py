"""Stream-resume benchmark: a Hugging Face `datasets` stream of 100,000 rows (128 token ids each, 8
JSON-lines shards), read by fastai's `DataLoader(stream, indexed=False, n=...)` in batches of 32, resumed
at 10%, 50% and 90% of its epoch by a fresh process (`learn.load`), against the same script's start at 0%.

Contenders, in the same run, each resume in a new process: the plain stream (its state is complete: it
is loaded, nothing re-read) and the stream shuffled with `.shuffle(seed, buffer_size=1000)` (its state
leaves the buffer out: the epoch is replayed from its start, the trained batches read and discarded).
Measured: seconds from `fit` to the first trained batch; for the replay, against the time to train the
batches it skips, at the step time of this benchmark's small model and of a GPT-2-shaped one (4 layers,
256 wide, the same batches), both measured in the same run. Interleaved rounds, medians with min-max.

    python bench/streams.py [--rows 100000] [--rounds 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402
import report  # noqa: E402

SEQ, BS, VOCAB, SHARDS = 128, 32, 1000, 8
FRACS = (0.0, 0.1, 0.5, 0.9)


def write_shards(folder, rows):
    import numpy as np

    g = np.random.default_rng(0)
    names = []
    for s in range(SHARDS):
        name = os.path.join(folder, f"part-{s}.jsonl")
        with open(name, "w") as f:
            for _ in range(s, rows, SHARDS):
                f.write(json.dumps({"ids": g.integers(0, VOCAB, SEQ).tolist()}) + "\n")
        names.append(name)
    return names


def ids(r):
    import torch

    t = torch.tensor(r["ids"])
    return t, t[0]


def build(folder, rows, shuffled):
    import datasets
    import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
    import torch
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.torch_core import set_seed
    from torch import nn

    import fastai_resume  # noqa: F401

    datasets.disable_progress_bars()
    set_seed(0)
    files = sorted(os.path.join(folder, "data", f) for f in os.listdir(os.path.join(folder, "data")))
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    if shuffled:
        ds = ds.shuffle(seed=0, buffer_size=1000)
    train = DataLoader(ds, bs=BS, indexed=False, n=rows, after_item=ids)
    valid = DataLoader([(torch.zeros(SEQ, dtype=torch.long), 0)] * BS, bs=BS)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Linear(8 * SEQ, VOCAB))
    path = os.path.join(folder, "shuffled" if shuffled else "plain")
    return Learner(DataLoaders(train, valid, path=path, device="cpu"), model, loss_func=nn.CrossEntropyLoss())


def child_make(folder, rows, shuffled):
    "One run that saves a checkpoint at each fraction of the epoch, then stops."
    from fastai.callback.core import Callback, CancelFitException

    learn = build(folder, rows, shuffled)
    ks = {int(rows // BS * f): f"at{int(100 * f)}" for f in FRACS if f}

    class SaveAt(Callback):
        order = 100

        def after_batch(self):
            name = ks.get(self.iter + 1) if self.training else None
            if name:
                self.learn.save(name, with_iter=True)
                if self.iter + 1 == max(ks):
                    raise CancelFitException()

    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=SaveAt())


def child_resume(folder, rows, shuffled, frac):
    "Seconds from `fit` to the first trained batch, and the step time of the next 20 batches."
    from fastai.callback.core import Callback, CancelFitException

    learn = build(folder, rows, shuffled)
    if frac:
        learn.load(f"at{int(100 * frac)}")

    class Probe(Callback):
        order = 1000

        def __init__(self):
            self.times = []

        def before_batch(self):
            if self.training:
                self.times.append(time.perf_counter())
                if len(self.times) > 20:
                    raise CancelFitException()

    probe = Probe()
    t0 = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=probe)
    steps = [b - a for a, b in zip(probe.times, probe.times[1:])]
    return {"start_s": probe.times[0] - t0, "step_s": sorted(steps)[len(steps) // 2]}


def child_llm_step(folder, rows):
    "The step time of a GPT-2-shaped model (4 layers, 256 wide) on the stream's batches, median of 4."
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    learn = build(folder, rows, False)
    it = iter(learn.dls.train)
    times = []
    for _ in range(5):
        x, _y = next(it)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times[1:])[2]}


def child(args):
    what, folder, rows, shuffled, frac = args[0], args[1], int(args[2]), args[3] == "1", float(args[4])
    out = {
        "make": lambda: child_make(folder, rows, shuffled),
        "resume": lambda: child_resume(folder, rows, shuffled, frac),
        "llm": lambda: child_llm_step(folder, rows),
    }[what]()
    print("RESULT " + json.dumps(out or {}), flush=True)


def run_child(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"child {args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    machine = common.machine(HERE)
    runs = {(sh, f): {"start_s": [], "step_s": []} for sh in (False, True) for f in FRACS}
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "data"))
        t0 = time.perf_counter()
        write_shards(os.path.join(d, "data"), a.rows)
        print(f"wrote {a.rows:,} rows in {SHARDS} shards in {time.perf_counter() - t0:.1f} s", flush=True)
        for sh in (False, True):
            run_child("make", d, a.rows, int(sh), 0)
        llm = []
        for r in range(a.rounds):  # interleaved: each round runs every contender at every fraction
            for sh in (False, True):
                for f in FRACS:
                    res = run_child("resume", d, a.rows, int(sh), f)
                    for key in res:
                        runs[(sh, f)][key].append(res[key])
                    print(
                        f"  round {r} {'shuffled' if sh else 'plain   '} at {100 * f:3.0f}%: start "
                        f"{res['start_s'] * 1e3:8.1f} ms, step {res['step_s'] * 1e3:.2f} ms",
                        flush=True,
                    )
            llm.append(run_child("llm", d, a.rows, 0, 0)["step_s"])
    n_iter = a.rows // BS
    rows = []
    for sh in (False, True):
        zero = runs[(sh, 0.0)]["start_s"]
        for f in FRACS:
            m, k = runs[(sh, f)], int(n_iter * f)
            row = {
                "stream": "shuffled (replayed)" if sh else "plain (its state)",
                "fraction": f,
                "k": k,
                "start_s": common.stats(m["start_s"]),
                "over_start_at_0": common.stats([x / y for x, y in zip(m["start_s"], zero)]),
            }
            if sh and f:  # the replay's cost against the training it saves (paired by round)
                extra = [x - y for x, y in zip(m["start_s"], zero)]
                row["replay_over_training"] = common.stats([e / (k * s) for e, s in zip(extra, m["step_s"])])
                row["replay_over_llm_training"] = common.stats([e / (k * s) for e, s in zip(extra, llm)])
            rows.append(row)
    payload = {
        "machine": machine,
        "rounds": a.rounds,
        "rows_per_epoch": a.rows,
        "bs": BS,
        "seq": SEQ,
        "llm_step_s": common.stats(llm),
        "small_step_s": common.stats([s for (sh, f), m in runs.items() for s in m["step_s"]]),
        "results": rows,
    }
    report.publish("streams", payload, a.json)


if __name__ == "__main__":
    main()
