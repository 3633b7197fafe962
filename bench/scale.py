"""Checkpoint costs at LLM scale: thousands of tensors. A real fastai Learner whose model is shaped
like a GPT (token and position embeddings, N transformer blocks of 12 parameters each, a head)
trained one step with fastai's Adam, so that its checkpoint holds model, optimizer buffers and
step counts: about 50 tensors per block. Widths are small (64) so that the cost per tensor, not
the bytes, is what is measured, and both sizes run in seconds.

For two depths (2x the tensors), median and min-max over interleaved rounds, of: save (the
tree `learn.save` writes, fsynced), load (`fastai_resume.load`, every checksum verified), info
(`fastai_resume.info(verify=False)`: the index and tensor table, what `inspect` shows), verify
(`fastai_resume.info(verify=True)`: what `fastai-resume verify` runs, and what `AutoCheckpoint`'s
autoresume runs on the newest file) and `learn.load` (restoring it into the Learner: the rest of
an autoresume). Costs linear in the tensor count give the same time per tensor at both sizes.

    python bench/scale.py [--blocks 48,96] [--rounds 5]
"""

import argparse
import os
import shutil
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
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.losses import CrossEntropyLossFlat  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402

import fastai_resume as fr  # noqa: E402
from fastai_resume import checkpoint  # noqa: E402

WIDTH, VOCAB, SEQ = 64, 256, 16
OPS = ("save", "load", "info", "verify", "learn.load")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, blocks, d=WIDTH):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def trained_learner(path, blocks):
    "A Learner after one training step: Adam's buffers exist for every parameter."
    set_seed(0)
    xs, ys = torch.randint(0, VOCAB, (4, SEQ)), torch.randint(0, VOCAB, (4, SEQ))
    dl = DataLoader(list(zip(xs, ys)), bs=4)
    learn = Learner(
        DataLoaders(dl, DataLoader(list(zip(xs, ys)), bs=4), device="cpu", path=path),
        GPT(blocks),
        loss_func=CrossEntropyLossFlat(),
    )
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3)
    return learn


def measure(learn, folder):
    "One round of every operation on this learner's checkpoint; returns seconds per operation."
    t = {}
    path = folder / "ckpt.frk"
    t0 = time.perf_counter()
    fr.save(checkpoint.build_tree(learn, with_opt=True), path)  # what learn.save writes, fsynced
    t["save"] = time.perf_counter() - t0
    for op, f in (
        ("load", lambda: fr.load(path)),
        ("info", lambda: fr.info(path, verify=False)),
        ("verify", lambda: fr.info(path, verify=True)),
        ("learn.load", lambda: learn.load(path)),
    ):
        t0 = time.perf_counter()
        f()
        t[op] = time.perf_counter() - t0
    return t, fr.info(path, verify=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="48,96", help="depths, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    depths = [int(b) for b in a.blocks.split(",")]
    info = common.machine(HERE)
    times = {b: {op: [] for op in OPS} for b in depths}
    facts = {}
    with tempfile.TemporaryDirectory(dir=HERE) as d:
        learners = {b: trained_learner(os.path.join(d, str(b)), b) for b in depths}
        for r in range(a.rounds):
            for b, learn in learners.items():
                folder = learn.path / learn.model_dir
                folder.mkdir(parents=True, exist_ok=True)
                t, inf = measure(learn, folder)
                facts[b] = {"tensors": len(inf["tensors"]), "blobs": len(inf["blobs"]), "bytes": inf["size"]}
                for op in OPS:
                    times[b][op].append(t[op])
                print(
                    f"  round {r}: {b:3d} blocks, {facts[b]['tensors']:5d} tensors: "
                    + "  ".join(f"{op} {1e3 * t[op]:7.1f} ms" for op in OPS),
                    flush=True,
                )
        shutil.rmtree(d, ignore_errors=True)
    rows = [{"blocks": b, **facts[b], **{op: common.stats(times[b][op]) for op in OPS}} for b in depths]
    payload = {"machine": info, "rounds": a.rounds, "width": WIDTH, "rows": rows}
    report.publish("scale", payload, a.json)


if __name__ == "__main__":
    main()
