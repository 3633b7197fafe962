"""A fastai fine-tuner's streamed data, as users build it, in a real training script run as separate
processes by tests/test_streams.py:

    python tests/streams.py PIPELINE --path DIR --out OUT [--die E,K] [--load NAME | --auto N]
                            [--workers N] [--set-epoch] [--ranks]

The training data is a Hugging Face `datasets` stream (`load_dataset("json", data_files=shards,
streaming=True)`) of JSON-lines shards this script writes into DIR/data (the digits of scikit-learn,
as numbers), read by fastai's `DataLoader(stream, indexed=False, n=..., num_workers=...)`.
PIPELINE: `plain`; `map-filter` (`.map` then `.filter`); `shuffle` (`.shuffle(seed, buffer_size)`);
`interleave` (`interleave_datasets` of two streams with probabilities and a seed); `stateful` (the
`custom` stream through torchdata's `StatefulDataLoader` in fastai's `DataLoaders`); `custom` (a
stream of the user's own with `state_dict`/`load_state_dict` and a length, one pass per `__iter__`);
`off-by-one` (the same, whose loaded state resumes a row late: a state that does not reproduce);
`sticky` (the same, whose loaded state applies to every later pass); `early-end` (the same, whose
loaded state ends the pass a batch later).
--set-epoch: a callback calls `set_epoch(epoch)` on the stream before each epoch, as scripts do.
--noise: a random item transform (in the worker processes, with --workers).
--ranks: under torchrun with `distrib_ctx`: the stream split with `split_dataset_by_node`.
--stages: `fit_one_cycle(1)` first, as `fine_tune` fits twice (--die then counts in the second stage).
--die E,K: after K training batches of epoch E, save `crash` (or, with --auto, let AutoCheckpoint have
saved) and die by SIGKILL (--die-later N: N batches after that save). --load NAME: `learn.load(NAME)` at the top of the script.
The final model, optimizer, Recorder, and the CRC of every training batch's data go to OUT.
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import zlib

import torch
from torch import nn

sys.path[:0] = [
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
]
import fastai.callback.schedule  # noqa: E402,F401
from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.losses import CrossEntropyLossFlat  # noqa: E402
from fastai.metrics import accuracy  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402
from results import learner_result  # noqa: E402

import fastai_resume  # noqa: E402

N_SHARDS, ROWS = 4, 1600


def write_shards(folder):
    "The digits as JSON lines in N_SHARDS files (written once; the same bytes every time)."
    os.makedirs(folder, exist_ok=True)
    names = [os.path.join(folder, f"part-{i}.jsonl") for i in range(N_SHARDS)]
    if all(os.path.exists(n) for n in names):
        return names
    from sklearn.datasets import load_digits

    d = load_digits()
    for s, name in enumerate(names):
        tmp = f"{name}.tmp{os.getpid()}"  # (ranks write them at once)
        with open(tmp, "w") as f:
            for i in range(s, ROWS, N_SHARDS):
                f.write(json.dumps({"id": i, "x": [float(v) / 16 for v in d.data[i]], "y": int(d.target[i])}) + "\n")
        os.replace(tmp, name)
    return names


def row(r):
    "A streamed row as fastai's (input, target)."
    return torch.tensor(r["x"], dtype=torch.float32), int(r["y"])


def noisy_row(r):
    "The row with a random item transform (drawn where the item is made: in a worker process, with workers)."
    x, y = row(r)
    return x + 0.05 * torch.randn(64), y


def scaled(r):
    return {**r, "x": [v * 0.5 + 0.25 for v in r["x"]]}


def not_nine(r):
    return r["y"] != 9


class CustomStream(torch.utils.data.IterableDataset):
    "A user's own stream with state_dict/load_state_dict: rows in order, one pass per `__iter__`."

    def __init__(self, files, n):
        self.files, self.n, self.pos, self.start = files, n, 0, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        start, self.start, self.pos = self.start, 0, self.start
        rows = [json.loads(line) for f in self.files for line in open(f)]
        for r in rows[start : self.n]:
            self.pos += 1
            yield r

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, st):
        self.start = st["pos"]


class Sticky(CustomStream):
    "A stream whose loaded state applies to every later pass, as a `datasets` stream's does (unknown here)."

    def __iter__(self):
        rows = [json.loads(line) for f in self.files for line in open(f)]
        self.pos = self.start
        for r in rows[self.start : self.n]:
            self.pos += 1
            yield r


class EarlyEnd(CustomStream):
    "A stream whose loaded state ends its pass one batch later (a bug no one sees): the epoch ends early."

    def load_state_dict(self, st):
        self.start, self.stop = st["pos"], st["pos"] + 32

    def __iter__(self):
        n, self.n = self.n, getattr(self, "stop", None) or self.n
        try:
            yield from super().__iter__()
        finally:
            self.n, self.stop = n, None


class OffByOne(CustomStream):
    "A stream whose state is wrong: it resumes one row later than it was (a bug no one sees)."

    def load_state_dict(self, st):
        self.start = st["pos"] + 1


def stream(a, files):
    import datasets

    datasets.disable_progress_bars()
    if a.pipeline in ("custom", "stateful", "off-by-one", "sticky", "early-end"):
        cls = {"off-by-one": OffByOne, "sticky": Sticky, "early-end": EarlyEnd}.get(a.pipeline, CustomStream)
        return cls(files, 640)
    load = lambda fs: datasets.load_dataset("json", data_files=fs, split="train", streaming=True)  # noqa: E731
    if a.pipeline == "interleave":
        ds = datasets.interleave_datasets(
            [load(files[:2]), load(files[2:])], probabilities=[0.7, 0.3], seed=3, stopping_strategy="all_exhausted"
        )
    else:
        ds = load(files)
    if a.pipeline == "map-filter":
        ds = ds.map(scaled).filter(not_nine)
    if a.pipeline == "shuffle":
        ds = ds.shuffle(seed=7, buffer_size=64)
    if a.ranks:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return ds


class SetEpoch(Callback):
    "What a script does for a shuffled stream: a new shuffle each epoch."

    def before_epoch(self):
        self.dls.train.dataset.set_epoch(self.epoch)


class BatchCRCs(Callback):
    "The CRC32 of every training batch's data, by (epoch, iter): what the run trained on."

    order = -10

    def __init__(self):
        self.crcs = {}

    def before_batch(self):
        if self.training:
            h = 0
            for t in (*self.xb, *self.yb):
                h = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), h)
            self.crcs[f"{self.epoch},{self.iter}"] = h


class SaveAndDie(Callback):
    order = 100

    def __init__(self, at, save, later=0, in_valid=False):
        self.at, self.save, self.later, self.in_valid, self.saved = at, save, later, in_valid, False

    def after_batch(self):
        if not self.training:
            if self.in_valid and self.saved:  # killed in the validation after the save
                os.kill(os.getpid(), signal.SIGKILL)
            return
        e, k = self.at
        self.saved = self.saved or (self.epoch, self.iter + 1) == (e, k)
        if self.save and (self.epoch, self.iter + 1) == (e, k):
            self.learn.save("crash", with_iter=True)
        if (self.epoch, self.iter + 1) == (e, k + self.later):
            os.kill(os.getpid(), signal.SIGKILL)


def build(a):
    set_seed(42)
    files = write_shards(os.path.join(a.path, "data"))
    ds = stream(a, files)
    n = 480 if a.pipeline == "map-filter" else 640
    if a.ranks:
        n //= 2
    if a.pipeline == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        train = StatefulDataLoader(ds, batch_size=32, num_workers=a.workers, collate_fn=collate)
    else:
        item = noisy_row if a.noise else row
        train = DataLoader(ds, bs=32, indexed=False, n=n, num_workers=a.workers, after_item=item)
    from sklearn.datasets import load_digits

    d = load_digits()
    valid = DataLoader(
        [(torch.tensor(x / 16, dtype=torch.float32), int(y)) for x, y in zip(d.data[1600:], d.target[1600:])], bs=128
    )
    dls = DataLoaders(train, valid, path=a.path, device="cpu")
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
    cbs = [BatchCRCs()] + ([SetEpoch()] if a.set_epoch else [])
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cbs, path=a.path)


def collate(rows):
    xs, ys = zip(*(row(r) for r in rows[:32]))
    return torch.stack(xs), torch.tensor(ys)


def result(learn):
    return {**learner_result(learn), "crcs": learn.batch_cr_cs.crcs}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "pipeline",
        choices=[
            "plain",
            "map-filter",
            "shuffle",
            "interleave",
            "stateful",
            "custom",
            "off-by-one",
            "sticky",
            "early-end",
        ],
    )
    ap.add_argument("--path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--set-epoch", action="store_true")
    ap.add_argument("--noise", action="store_true", help="a random item transform (noisy_row)")
    ap.add_argument("--ranks", action="store_true")
    ap.add_argument("--stages", action="store_true", help="a fit of one epoch first (a second stage, as fine_tune)")
    ap.add_argument("--die", default=None)
    ap.add_argument("--die-later", type=int, default=0, help="with --die E,K: save at K, die this many batches later")
    ap.add_argument("--die-in-valid", action="store_true", help="with --die E,K: die in the validation after it")
    ap.add_argument("--load", default=None)
    ap.add_argument("--auto", type=int, default=0)
    ap.add_argument("--fast-forward", action="store_true")
    a = ap.parse_args(argv)
    learn = build(a)
    if a.auto:
        learn.add_cb(fastai_resume.AutoCheckpoint(every_iters=a.auto, keep=2, fast_forward=a.fast_forward))
    if a.die:
        learn.add_cb(
            SaveAndDie(tuple(map(int, a.die.split(","))), save=not a.auto, later=a.die_later, in_valid=a.die_in_valid)
        )
    if a.load:
        learn.load(a.load, fast_forward=a.fast_forward)
    ctx = contextlib.nullcontext()
    if a.ranks:
        import fastai.distributed  # noqa: F401  (defines Learner.distrib_ctx)

        ctx = learn.distrib_ctx(cpu=True)
    with ctx, learn.no_bar():
        if a.stages:  # fine_tune's shape: a stage, then another fit of the same stream
            learn.fit_one_cycle(1, 1e-2)
        learn.fit_one_cycle(a.epochs, 1e-2)
    res = result(learn)
    rank = os.environ.get("RANK")
    fastai_resume.save(res, a.out if rank in (None, "0") else f"{a.out}.rank{rank}")


if __name__ == "__main__":
    main()
