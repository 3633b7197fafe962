"""Real fastai training scripts on the pipelines users train with, run as separate processes by the
exactness tests:

    python tests/workloads.py PIPELINE --path DIR --out OUT [--recipe one|stages] [--die S,E,K]
                              [--load NAME | --auto N | --auto-per-fit N] [options]

PIPELINE: `lm` (LMDataLoader(shuffle=True) and an AWD-LSTM language model with fastai's RNN callbacks),
`vision` (a DataBlock of images with RandomResizedCrop in 2 worker processes and aug_transforms),
`torch` (plain PyTorch DataLoaders in fastai's DataLoaders), `stream` / `stream-nostate` (a PyTorch
IterableDataset with / without state_dict), `stream-fastai` (the stream with state_dict through fastai's
DataLoader(indexed=False, n=...): an epoch of n items), `sorted` (fastai's SortedDL, the text
classifier's training loader), `tfmd` (a TfmdDL over a plain list with a random after_batch
transform), `digits` (an MLP; with --train-metrics and --die-order), `block` (the digits through a
DataBlock, whose loaders `learn.export` can pickle).
RECIPE: `one` (fit_one_cycle(3)), `stages` (the ULMFiT-style script: lr_find, fit_one_cycle,
freeze_to(-2), fit_one_cycle, unfreeze, fit_one_cycle, with a CSVLogger) or `five` (five stages with
what scripts do between them: prints, validate, save, load, lr_find, export; `five_stages`).
--die S,E,K: in stage S, after K training batches of epoch E, save `crash` (or, with --auto, let
AutoCheckpoint have saved) and die by SIGKILL. --load NAME: `learn.load(NAME)` at the top of the script.
--auto N: one AutoCheckpoint(every_iters=N) in the Learner's callbacks; --auto-per-fit N: a new one
given to each training call (`fit_one_cycle(..., cbs=[AutoCheckpoint(...)])`).
The final model, optimizer, Recorder and the next draw of every RNG go to OUT.
"""

import argparse
import hashlib
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fastai.callback.schedule  # noqa: E402,F401
from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.hook import ActivationStats  # noqa: E402
from fastai.callback.progress import CSVLogger  # noqa: E402
from fastai.callback.rnn import ModelResetter  # noqa: E402
from fastai.data.core import DataLoaders, TfmdDL  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.losses import CrossEntropyLossFlat  # noqa: E402
from fastai.metrics import accuracy  # noqa: E402
from fastai.torch_core import Module, set_seed, tensor, trainable_params  # noqa: E402
from fastcore.foundation import L  # noqa: E402
from fasttransform import Transform  # noqa: E402
from results import learner_result  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import fastai_resume  # noqa: E402
import fastai_resume.script  # noqa: E402
from fastai_resume.between import file_crc  # noqa: E402


class SaveAndDie(Callback):
    """In stage S, after K training batches of epoch E: save `crash` (unless AutoCheckpoint does) and SIGKILL.
    `event='after_epoch'`: at the end of epoch E; `event='valid'`: after K validation batches of epoch E."""

    def __init__(self, at, save=True, order=100, event="after_batch"):
        self.at, self.do_save, self.order, self.event = at, save, order, event

    def after_epoch(self):
        sc = fastai_resume.script.script(self.learn)
        if self.event == "after_epoch" and sc.stage is not None and (sc.stage.index, self.epoch) == self.at[:2]:
            self._die()

    def after_batch(self):
        sc = fastai_resume.script.script(self.learn)
        if sc.stage is None or sc.session is None or self.event == "after_epoch":
            return
        if self.training != (self.event == "after_batch"):
            return
        if (sc.stage.index, self.epoch, self.iter + 1) != self.at:
            return
        self._die()

    def _die(self):
        if self.do_save:
            self.learn.save("crash", with_iter=True)
        else:
            auto = next(c for c in self.learn.cbs if isinstance(c, fastai_resume.AutoCheckpoint))
            auto._check_inflight(block=True)
            m = auto._mirror  # --remote: dies once the remote has it (a test then deletes this machine's disk)
            if m is not None:
                with m.cond:
                    m.cond.wait_for(lambda: m.newest == auto.saved[-1].name, timeout=120)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class SaveEvery(Callback):
    "What a user writes to save a resumable checkpoint every N training batches."

    order = 90

    def __init__(self, n):
        self.n = n

    def after_batch(self):
        if self.training and self.learn.train_iter % self.n == 0:
            self.learn.save("crash", with_iter=True)


class Trace(Callback):
    "Records a checksum of every training batch's input (to find where two runs part)."

    order = 1

    def __init__(self):
        self.sums = []

    def before_batch(self):
        if self.training:
            self.sums.append(float(self.xb[0].double().sum()))


class PlantedDivergence(Callback):
    "Perturbs each batch from a generator of its own that no checkpoint knows (a planted divergence)."

    order = 0

    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def before_batch(self):
        if self.training:
            self.learn.xb = (self.xb[0] + 0.01 * torch.randn(self.xb[0].shape, generator=self.g),)


def digits():
    X, y = load_digits(return_X_y=True)
    return torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)


class Noise:
    def __call__(self, item):
        x, y = item
        return x + 0.05 * torch.randn_like(x), y


def mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def mlp_split(m):
    return [list(m[0].parameters()), list(m[3].parameters()), list(m[5].parameters())]


class NoisyDigits(torch.utils.data.Dataset):
    def __init__(self, xs, ys):
        self.xs, self.ys = xs, ys

    def __len__(self):
        return len(self.xs)

    def __getitem__(self, i):
        return self.xs[i] + 0.05 * torch.randn(64), self.ys[i]


class DigitStream(torch.utils.data.IterableDataset):
    "A stream of noisy digits (one pass per epoch), resumable through state_dict/load_state_dict."

    def __init__(self, xs, ys):
        self.xs, self.ys, self.pos, self.resume_at = xs, ys, 0, 0

    def __iter__(self):
        start, self.resume_at = self.resume_at, 0
        for i in range(start, len(self.xs)):
            self.pos = i + 1
            yield self.xs[i] + 0.05 * torch.randn(64), self.ys[i]
        self.pos = 0

    def __len__(self):
        return len(self.xs)


class StatefulDigitStream(DigitStream):
    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, st):
        self.resume_at = st["pos"]


class RandomScale(Transform):
    "A random after_batch transform (drawn from torch's global RNG in the main process)."

    order = 5

    def encodes(self, b: torch.Tensor):
        return b * (1 + 0.1 * torch.rand(1)) if b.is_floating_point() else b


def words(n):
    "`n` in English words (the book's Human Numbers dataset, which this machine cannot download)."
    ones = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    ones = (ones + "seventeen eighteen nineteen").split()
    tens = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
    if n < 20:
        return [ones[n]]
    if n < 100:
        return [tens[n // 10]] + ([ones[n % 10]] if n % 10 else [])
    return [ones[n // 100], "hundred"] + (words(n % 100) if n % 100 else [])


def group_chunks(ds, bs):
    "The book's: each batch's row i continues row i of the batch before."
    m = len(ds) // bs
    new_ds = L()
    for i in range(m):
        new_ds += L(ds[i + m * j] for j in range(bs))
    return new_ds


class CarriedRNN(Module):
    "The book's chapter 12 RNN without `reset`: its hidden state `h` (the int 0 at first) goes on across fits."

    def __init__(self, vocab_sz, n_hidden):
        self.i_h = nn.Embedding(vocab_sz, n_hidden)
        self.h_h = nn.Linear(n_hidden, n_hidden)
        self.h_o = nn.Linear(n_hidden, vocab_sz)
        self.h = 0

    def forward(self, x):
        for i in range(3):
            self.h = self.h + self.i_h(x[:, i])
            self.h = F.relu(self.h_h(self.h))
        out = self.h_o(self.h)
        self.h = self.h.detach()
        return out


class LMModel3(CarriedRNN):
    "The book's chapter 12 RNN as written there: `reset` (fastai calls it as each fit starts) zeroes `h`."

    def reset(self):
        self.h = 0


class LMModel7(Module):
    "The book's chapter 12 LSTM: a list of two hidden tensors between batches, reset in place."

    def __init__(self, vocab_sz, n_hidden, n_layers, p, bs):
        self.i_h = nn.Embedding(vocab_sz, n_hidden)
        self.rnn = nn.LSTM(n_hidden, n_hidden, n_layers, batch_first=True)
        self.drop = nn.Dropout(p)
        self.h_o = nn.Linear(n_hidden, vocab_sz)
        self.h_o.weight = self.i_h.weight
        self.h = [torch.zeros(n_layers, bs, n_hidden) for _ in range(2)]

    def forward(self, x):
        raw, h = self.rnn(self.i_h(x), self.h)
        out = self.drop(raw)
        self.h = [h_.detach() for h_ in h]
        return self.h_o(out)

    def reset(self):
        for h in self.h:
            h.zero_()


def book_rnn(pipeline, path, carried=False):
    tokens = [w for n in range(1, 1200) for w in [*words(n), "."]]
    vocab = L(*tokens).unique()
    word2idx = {w: i for i, w in enumerate(vocab)}
    nums = L(word2idx[t] for t in tokens)
    bs = 16
    if pipeline == "book-rnn3":
        seqs = L((tensor(nums[i : i + 3]), nums[i + 3]) for i in range(0, len(nums) - 4, 3))
        model = (CarriedRNN if carried else LMModel3)(len(vocab), 32)
    else:
        sl = 16
        seqs = L((tensor(nums[i : i + sl]), tensor(nums[i + 1 : i + sl + 1])) for i in range(0, len(nums) - sl - 1, sl))
        model = LMModel7(len(vocab), 32, 2, 0.4, bs)
    cut = int(len(seqs) * 0.8)
    dls = DataLoaders.from_dsets(
        group_chunks(seqs[:cut], bs), group_chunks(seqs[cut:], bs), bs=bs, drop_last=True, shuffle=False, path=path
    )
    return dls, model


def build(a):
    set_seed(42)
    xs, ys = digits()
    cbs, kw, splitter = [], {}, None
    if a.pipeline == "block":  # a DataBlock's loaders (what `learn.export` needs), digits as tensors
        from fastai.data.block import CategoryBlock, DataBlock, TransformBlock
        from fastai.data.transforms import IndexSplitter, ItemGetter

        items = list(zip(xs[:720], ys[:720].tolist()))
        block = DataBlock(
            blocks=(TransformBlock, CategoryBlock),
            get_x=ItemGetter(0),
            get_y=ItemGetter(1),
            splitter=IndexSplitter(range(600, 720)),
        )
        dls = block.dataloaders(items, bs=32, path=a.path, device="cpu", drop_last=True)
        model, splitter, loss = mlp(), mlp_split, CrossEntropyLossFlat()
        kw["metrics"] = accuracy
    elif a.pipeline in ("weighted", "partial"):  # fastai.callback.data's loaders: get_idxs draws from NumPy
        import fastai.callback.data  # noqa: F401  (Datasets.weighted_dataloaders, partial_dataloaders)
        from fastai.data.core import Datasets
        from fastai.data.transforms import ItemGetter

        n, items = 600, list(zip(xs[:600], ys[:600])) + list(zip(xs[1500:], ys[1500:]))
        dsets = Datasets(items, tfms=[[ItemGetter(0)], [ItemGetter(1)]], splits=[range(n), range(n, len(items))])
        kw_dl = dict(bs=32, path=a.path, device="cpu", after_batch=[RandomScale()])
        if a.pipeline == "weighted":
            dls = dsets.weighted_dataloaders(wgts=[1.0 + i % 3 for i in range(n)], drop_last=True, **kw_dl)
        else:
            dls = dsets.partial_dataloaders(partial_n=400, **kw_dl)
        model, splitter, loss = mlp(), mlp_split, CrossEntropyLossFlat()
        kw["metrics"] = accuracy
    elif a.pipeline in ("digits", "torch", "stream", "stream-nostate", "stream-fastai", "tfmd", "sorted"):
        n = 600
        tr, va = (xs[:n], ys[:n]), (xs[1500:], ys[1500:])
        if a.pipeline == "digits":
            train = DataLoader(list(zip(*tr)), bs=32, shuffle=True, drop_last=True, after_item=Noise())
            valid = DataLoader(list(zip(*va)), bs=128)
        elif a.pipeline == "torch":
            train = torch.utils.data.DataLoader(NoisyDigits(*tr), batch_size=32, shuffle=True, drop_last=True)
            valid = torch.utils.data.DataLoader(NoisyDigits(*va), batch_size=128)
        elif a.pipeline in ("stream", "stream-nostate"):
            cls = StatefulDigitStream if a.pipeline == "stream" else DigitStream
            train = torch.utils.data.DataLoader(cls(*tr), batch_size=32)
            valid = torch.utils.data.DataLoader(NoisyDigits(*va), batch_size=128)
        elif a.pipeline == "stream-fastai":  # fastai's DataLoader over a stream, an epoch of n items
            train = DataLoader(StatefulDigitStream(*tr), bs=32, indexed=False, n=n)
            valid = DataLoader(list(zip(*va)), bs=128)
        elif a.pipeline == "sorted":  # SortedDL: shuffle_fn draws from NumPy and returns an iterator
            from fastai.text.data import SortedDL

            lens = [int(i) % 7 for i in range(n)]
            train = SortedDL(list(zip(*tr)), res=lens, bs=32, shuffle=True, after_batch=[RandomScale()])
            valid = SortedDL(list(zip(*va)), res=[0] * len(va[0]), bs=128)
        else:
            train = TfmdDL(list(zip(*tr)), bs=32, shuffle=True, drop_last=True, after_batch=[RandomScale()])
            valid = TfmdDL(list(zip(*va)), bs=128)
        dls = DataLoaders(train, valid, path=a.path, device="cpu")
        model, splitter, loss = mlp(), mlp_split, CrossEntropyLossFlat()
        kw["metrics"] = accuracy
    elif a.pipeline in ("lm", "lm-text"):
        from fastai.callback.rnn import rnn_cbs
        from fastai.text.data import LMDataLoader
        from fastai.text.models.awdlstm import AWD_LSTM, awd_lstm_lm_config, awd_lstm_lm_split
        from fastai.text.models.core import get_language_model

        g = torch.Generator().manual_seed(0)
        docs = [torch.randint(0, 60, (int(n),), generator=g) for n in torch.randint(10, 40, (60,), generator=g)]
        tr, va = docs[:48], docs[48:]
        if a.pipeline == "lm-text":  # in fastai's TfmdLists, as TextDataLoaders makes them (export pickles them)
            from fastai.data.core import TfmdLists

            tl = TfmdLists(docs, None, splits=[range(48), range(48, 60)])
            tr, va = tl.train, tl.valid
        train = LMDataLoader(tr, bs=4, seq_len=10, shuffle=True)
        valid = LMDataLoader(va, bs=4, seq_len=10)
        dls = DataLoaders(train, valid, path=a.path, device="cpu")
        cfg = dict(awd_lstm_lm_config, emb_sz=8, n_hid=16, n_layers=2)
        model, splitter, loss = get_language_model(AWD_LSTM, 60, cfg), awd_lstm_lm_split, CrossEntropyLossFlat()
        if a.pipeline == "lm-text":  # what language_model_learner makes of it (its own rnn_cbs, save/load_encoder)
            from fastai.text.learner import LMLearner

            return LMLearner(dls, model, loss_func=loss, splitter=splitter, wd=0.01, path=a.path, metrics=accuracy)
        cbs += rnn_cbs()
    elif a.pipeline in ("book-rnn3", "book-rnn7"):  # the fastai book's chapter 12, as written there
        dls, model = book_rnn(a.pipeline, a.path, carried=a.no_resetter)
        splitter, loss = trainable_params, CrossEntropyLossFlat()
        kw["metrics"] = accuracy
        cbs += [] if a.no_resetter else [ModelResetter()]
    elif a.pipeline == "vision":
        from fastai.data.block import CategoryBlock, DataBlock
        from fastai.vision.augment import RandomResizedCrop, aug_transforms
        from fastai.vision.core import PILImage
        from fastai.vision.data import ImageBlock

        imgs = (xs.view(-1, 8, 8) * 255).to(torch.uint8).repeat_interleave(2, 1).repeat_interleave(2, 2).numpy()
        block = DataBlock(
            blocks=(ImageBlock, CategoryBlock),
            get_x=lambda i: PILImage.create(np.stack([imgs[i]] * 3, -1)),
            get_y=lambda i: int(ys[i]),
            splitter=lambda items: (list(range(0, 320)), list(range(320, 400))),
            item_tfms=RandomResizedCrop(12, min_scale=0.6),
            batch_tfms=aug_transforms(size=12, max_rotate=15, do_flip=False, max_lighting=0.3),
        )
        dls = block.dataloaders(list(range(400)), bs=16, num_workers=2, path=a.path, device="cpu", drop_last=True)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Conv2d(8, 16, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
        splitter, loss = (
            (lambda m: [list(m[0].parameters()), list(m[3].parameters()), list(m[7].parameters())]),
            CrossEntropyLossFlat(),
        )
        kw["metrics"] = accuracy
    learn = Learner(dls, model, loss_func=loss, splitter=splitter, wd=0.01, cbs=cbs, path=a.path, **kw)
    if a.train_metrics:
        learn.recorder.train_metrics = True
    return learn


def recipe(learn, a):
    def fit_cbs():  # --auto-per-fit: a new AutoCheckpoint given to each training call, as cbs=
        return [fastai_resume.AutoCheckpoint(every_iters=a.auto_per_fit, keep=2)] if a.auto_per_fit else []

    if a.recipe == "one":
        learn.fit_one_cycle(a.epochs, 1e-2, cbs=fit_cbs())
        return
    if a.recipe == "five":
        return five_stages(learn, a, fit_cbs)
    if a.recipe == "book":
        return book(learn, a)
    learn.add_cb(CSVLogger(append=a.csv_append))
    if not a.no_lr_find:
        learn.lr_find(num_it=20, show_plot=False)
    learn.freeze_to(-1)
    learn.fit_one_cycle(2, a.lr, cbs=fit_cbs())
    learn.freeze_to(-2)
    learn.fit_one_cycle(2, slice(1e-3, 1e-2), cbs=fit_cbs())
    learn.unfreeze()
    learn.fit_one_cycle(a.last_epochs, slice(1e-4, 1e-3), cbs=fit_cbs())


PRINTED = []  # what the script printed between its stages (`show`)


def show(tag, v):
    PRINTED.append(f"{tag} {[float(x) for x in v]}")
    print(f"VALUES {PRINTED[-1]}", flush=True)


def show_acts(learn, tag):
    "What a script reads of `ActivationStats` after a stage (the book's plots): every batch's stats, as a digest."
    if hasattr(learn, "activation_stats"):
        stats = learn.activation_stats.stats
        h = hashlib.sha256(repr([[{k: v for k, v in m.items() if k != "hist"} for m in b] for b in stats]).encode())
        for b in stats:
            for m in b:
                h.update(m["hist"].numpy().tobytes())
        PRINTED.append(f"{tag} {len(stats)} batches {type(stats).__name__} {h.hexdigest()[:16]}")
        print(f"VALUES {PRINTED[-1]}", flush=True)


def five_stages(learn, a, fit_cbs):
    """A script of five stages that does between them what scripts do: prints the Recorder's last row and
    `validate()`, saves and loads named models, runs lr_find and fits with its suggestion, exports."""
    learn.add_cb(CSVLogger(append=True))
    sug = learn.lr_find(num_it=12, show_plot=False)
    show("lr_find-0", list(sug))
    learn.freeze_to(-1)
    learn.fit_one_cycle(1, float(sug.valley) * 10, cbs=fit_cbs())  # stage 0, at the suggestion (fastai's recipe)
    show("stage-0", learn.recorder.values[-1])
    show_acts(learn, "acts-0")
    show("valid-0", learn.validate())
    learn.save("stage0")
    learn.freeze_to(-2)
    learn.fit_one_cycle(2, slice(1e-3, 1e-2), cbs=fit_cbs())  # stage 1
    show("stage-1", learn.recorder.values[-1])
    show_acts(learn, "acts-1")
    learn.save("stage1")
    learn = learn.load("stage0")
    show("valid-stage0", learn.validate())
    if a.branch_on_files and os.path.exists(os.path.join(a.path, "stage2.pkl")):
        learn = learn.load("stage0")  # a script that branches on what its folder holds: a rerun goes another way
    learn = learn.load("stage1")
    sug = learn.lr_find(num_it=12, show_plot=False)
    show("lr_find-2", list(sug))
    learn.unfreeze()
    learn.fit_one_cycle(1, float(sug.valley), cbs=fit_cbs())  # stage 2, at the suggested rate
    show("stage-2", learn.recorder.values[-1])
    show_acts(learn, "acts-2")
    with learn.removed_cbs(learn.csv_logger):  # fastai cannot pickle the logger's closed file
        learn.export("stage2.pkl")
    learn.fit(1, 1e-4, cbs=fit_cbs())  # stage 3
    show("stage-3", learn.recorder.values[-1])
    show_acts(learn, "acts-3")
    show("losses-3", learn.recorder.losses[-3:])
    learn.fine_tune(1, 1e-4, freeze_epochs=1, cbs=fit_cbs())  # stage 4: two fits
    show("stage-4", learn.recorder.values[-1])
    show_acts(learn, "acts-4")
    show("valid-4", learn.validate())


# What `book` does after each of its first two stages (`--between`), besides reading `recorder.values`.
BETWEEN = (
    "save-load",  # save('<j+1>epoch'), load('<j+1>epoch'): the book's save('1epoch'), load('1epoch')
    "load-other",  # load('init'), the .pth saved at the top
    "save-load-frk",  # the same as a fastai_resume file: save('<j+1>epoch', with_iter=True), load(...)
    "load-other-frk",  # load('init'), the .frk saved at the top
    "encoder",  # save_encoder('enc<j>'), load_encoder('enc<j>') (which freezes), unfreeze()
    "validate",
    "lr_find",
    "export",
    "get_preds",
)


def between_calls(learn, op, j):
    "The script's lines after stage `j`: print the Recorder's last row, then the `--between` variant's call."
    show(f"values-{j}", learn.recorder.values[-1])
    if op in ("save-load", "save-load-frk"):
        learn.save(f"{j + 1}epoch", with_iter=op.endswith("frk"))
        learn = learn.load(f"{j + 1}epoch")
    elif op in ("load-other", "load-other-frk"):
        learn = learn.load("init")
    elif op == "encoder":
        learn.save_encoder(f"enc{j}")
        learn = learn.load_encoder(f"enc{j}")
        learn.unfreeze()
    elif op == "validate":
        show(f"valid-{j}", learn.validate())
    elif op == "lr_find":
        show(f"lr_find-{j}", list(learn.lr_find(num_it=8, show_plot=False)))
    elif op == "export":
        learn.export(f"model{j}.pkl")
    elif op == "get_preds":
        preds, targs = learn.get_preds(reorder=False)  # (LMLearner concatenates on dim 1, which reorder cannot sort)
        PRINTED.append(f"preds-{j} {file_digest(preds)} {file_digest(targs)}")
        print(f"VALUES {PRINTED[-1]}", flush=True)
    return learn


def file_digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def keep_loaded_weights(learn, stage) -> None:
    """Negative control (issue 39's defect, as a stage-begin hook): the resumed fit does not put the
    checkpoint's model back unless a skipped stage's end state was kept, so it trains on from whatever a
    between-stage load left in the learner (the rule before the fix)."""
    a = fastai_resume.script.script(learn).armed
    if a is not None and not any(a.ends[: a.position["stage"]]):
        a.model = None


def book(learn, a):
    """The fastai book's chapter-10 language-model fine-tuning (frozen, fit_one_cycle; save('1epoch'),
    load('1epoch'); unfreeze, fit_one_cycle), one stage longer, with `--between`'s call after each of the
    first two stages. `--auto-in S`: an AutoCheckpoint given to stage S's call only (no resumable save in
    the stages before it)."""

    if a.keep_loaded_weights:
        fastai_resume.script.STAGE_BEGIN_HOOKS.append(keep_loaded_weights)

    def cbs(stage):
        return [fastai_resume.AutoCheckpoint(every_iters=a.auto_in_every, keep=2)] if stage == a.auto_in else []

    if a.between in ("load-other", "load-other-frk"):
        learn.create_opt()  # (a resumable save needs an optimizer)
        learn.save("init", with_iter=a.between.endswith("frk"))
    learn.freeze()
    learn.fit_one_cycle(1, 1e-2, cbs=cbs(0))  # stage 0
    learn = between_calls(learn, a.between, 0)
    learn.unfreeze()
    learn.fit_one_cycle(2, 1e-3, cbs=cbs(1))  # stage 1
    learn = between_calls(learn, a.between, 1)
    learn.fit_one_cycle(1, 1e-3, cbs=cbs(2))  # stage 2
    show("values-2", learn.recorder.values[-1])
    return learn


def result(learn):
    rng = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3)}
    csv = os.path.join(learn.path, "history.csv")
    text = open(csv).read() if os.path.exists(csv) else ""
    rows = [",".join(line.split(",")[:-1]) for line in text.splitlines()]  # without the time column
    return {
        **learner_result(learn),
        "rng": rng,
        "csv": "\n".join(rows),
        "printed": list(PRINTED),
        "files": {
            f: file_crc(os.path.join(learn.path, "models", f))
            for f in sorted(os.listdir(os.path.join(learn.path, "models")))
            if f.endswith(".pth") or (f.endswith(".frk") and not f.startswith(("crash", "auto")))  # book's .frk
        }
        if os.path.isdir(os.path.join(learn.path, "models"))
        else {},
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("pipeline")
    ap.add_argument("--path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="one")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--last-epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--die", default=None)
    ap.add_argument("--die-order", type=int, default=100)
    ap.add_argument("--die-event", default="after_batch", choices=["after_batch", "after_epoch", "valid"])
    ap.add_argument("--load", default=None)
    ap.add_argument("--auto", type=int, default=0)
    ap.add_argument("--auto-per-fit", type=int, default=0)
    ap.add_argument("--remote", default=None, help="with --auto: AutoCheckpoint(remote=URL)")
    ap.add_argument("--save-every", type=int, default=0, help="a user's callback saving `crash` every N batches")
    ap.add_argument("--branch-on-files", action="store_true", help="five: a between-stage load decided by the folder")
    ap.add_argument("--between", default="validate", choices=BETWEEN, help="book: the call after stages 0 and 1")
    ap.add_argument("--auto-in", type=int, default=-1, help="book: AutoCheckpoint given to this stage's call only")
    ap.add_argument("--auto-in-every", type=int, default=4)
    ap.add_argument("--keep-loaded-weights", action="store_true", help="book: negative control, `keep_loaded_weights`")
    ap.add_argument("--csv-append", action="store_true")
    ap.add_argument("--no-lr-find", action="store_true")
    ap.add_argument("--train-metrics", action="store_true")
    ap.add_argument("--fast-forward", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--plant", action="store_true", help="a callback with RNG state no checkpoint holds")
    ap.add_argument(
        "--no-resetter", action="store_true", help="book-rnn3: no ModelResetter, no reset(): h goes on across fits"
    )
    ap.add_argument("--act-stats", action="store_true", help="fastai's ActivationStats(with_hist=True, every=2)")
    ap.add_argument("--break-order", action="store_true", help="negative control: forget the loaders' saved order")
    ap.add_argument(
        "--break-epoch-rng", action="store_true", help="negative control: the epoch's start RNG replaced by the save's"
    )
    a = ap.parse_args(argv)
    learn = build(a)
    if a.trace:
        learn.add_cb(Trace())
    if a.plant:
        learn.add_cb(PlantedDivergence())
    if a.act_stats:
        learn.add_cb(ActivationStats(with_hist=True, every=2))
    if a.save_every:
        learn.add_cb(SaveEvery(a.save_every))
    if a.auto:
        remote = dict(remote=a.remote) if a.remote else {}
        learn.add_cb(fastai_resume.AutoCheckpoint(every_iters=a.auto, keep=2, fast_forward=a.fast_forward, **remote))
    if a.die:
        at = tuple(map(int, a.die.split(",")))
        learn.add_cb(
            SaveAndDie(at, save=not (a.auto or a.auto_per_fit or a.auto_in >= 0), order=a.die_order, event=a.die_event)
        )
    if a.load:
        learn.load(a.load, fast_forward=a.fast_forward)
        if a.break_order:
            tr = fastai_resume.script.script(learn).armed.train
            tr["loaders_epoch"] = [
                dict(st, order=list(range(len(st["order"])))) if "order" in st else st for st in tr["loaders_epoch"]
            ]
        if a.break_epoch_rng:
            tr = fastai_resume.script.script(learn).armed.train
            tr["rng_epoch"] = tr["rng"]
    with learn.no_bar():
        learn = recipe(learn, a) or learn
    res = result(learn)
    if a.trace:
        res["trace"] = learn.trace.sums
    fastai_resume.save(res, a.out)


if __name__ == "__main__":
    main()
