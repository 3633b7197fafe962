"""A real fastai training run on scikit-learn's bundled digits, used by the exactness tests as a
separate process: `python tests/trainer.py --out result.frk [--die-at E,K] [--resume NAME] ...`.

It builds the learner the same way every time (as a user's script would), optionally saves at
epoch E after K batches and dies hard (SIGKILL), optionally loads a checkpoint first, trains, and
writes the final model and optimizer state and the Recorder's history to `--out`.
"""

import argparse
import contextlib
import os
import signal
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fastai.callback.schedule  # noqa: E402,F401  (fit_one_cycle and friends, as fastai.vision.all imports them)
from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.tracker import EarlyStoppingCallback, SaveModelCallback  # noqa: E402
from fastai.callback.training import GradientAccumulation  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.losses import CrossEntropyLossFlat  # noqa: E402
from fastai.metrics import accuracy  # noqa: E402
from fastai.optimizer import OptimWrapper  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import fastai_resume  # noqa: E402  (patches fastai)
import fastai_resume.loaders  # noqa: E402
import fastai_resume.script  # noqa: E402


class Noise:
    "A random per-item augmentation drawn from torch's global RNG (so RNG state matters)."

    def __call__(self, item):
        x, y = item
        return x + 0.05 * torch.randn_like(x), y


class SaveAndDie(Callback):
    "Saves a resumable checkpoint at a chosen point of the fit, then dies as a crash would."

    order = 100

    def __init__(self, epoch, k, name, event="after_batch", dump=None):
        self.at, self.fname, self.event, self.dump = (epoch, k), name, event, dump
        setattr(self, event, self._maybe)

    def _maybe(self):
        if self.event == "after_batch":
            if not self.training or (self.epoch, self.iter + 1) != self.at:
                return
        elif self.epoch != self.at[0]:
            return
        self.learn.save(self.fname, with_iter=True)
        if self.dump is not None:  # the state at the save, taken from the live learner (gathered if sharded)
            fastai_resume.save(model_state(self.learn), self.dump)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class Slow(Callback):
    "Makes each training batch take longer (no RNG, no state): kill windows get wider."

    def __init__(self, ms):
        self.s = ms / 1000

    def after_batch(self):
        if self.training:
            import time

            time.sleep(self.s)


def build(path, nw=0, noise=True, bs=32, torch_opt=False, extra_cbs=(), bn=False):
    set_seed(42)
    X, y = load_digits(return_X_y=True)
    xs = torch.tensor(X / 16.0, dtype=torch.float32)
    items = list(zip(xs, torch.tensor(y)))
    kw = dict(after_item=Noise()) if noise else {}
    train = DataLoader(items[:1500], bs=bs, shuffle=True, drop_last=True, num_workers=nw, **kw)
    valid = DataLoader(items[1500:], bs=128, num_workers=0)
    dls = DataLoaders(train, valid, device="cpu", path=path)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))
    if bn:  # BatchNorm (per-rank statistics under FSDP) and rows that no world size of 2 or 4 divides evenly
        model = nn.Sequential(nn.Linear(64, 37), nn.BatchNorm1d(37), nn.ReLU(), nn.Dropout(0.3), nn.Linear(37, 10))
    opt = {}
    if torch_opt:
        from functools import partial

        opt = dict(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))
    return Learner(
        dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, wd=0.01, cbs=list(extra_cbs), path=path, **opt
    )


class SeenItems(Callback):
    "Records the dataset index of every training item each epoch loads (num_workers=0)."

    def __init__(self, dl):
        self.seen, self.orig = {}, dl.create_item
        dl.create_item = self._item

    def _item(self, s):
        self.seen.setdefault(self.learn.epoch, []).append(int(s))
        return self.orig(s)


def full(tree):
    "`tree` with every DTensor gathered whole (a collective: every rank calls it), for comparing across world sizes."
    from fastai_resume.dist import is_dtensor

    if is_dtensor(tree):
        return tree.full_tensor()
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: full(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(full(v) for v in tree)
    return tree


def model_state(learn):
    "The model and optimizer state: each rank's own part of a sharded one (`local`), and whole (`full`)."
    from fastai_resume.sharded import localize

    model, opt = learn.model.state_dict(), fastai_resume.state.plain(learn.opt.state_dict())
    return {
        "model": {k: v.clone() for k, v in localize(model)[0].items()},
        "opt": localize(opt)[0],
        "full_model": full(model),
        "full_opt": full(opt),
    }


def kill_in_save(rank, n):
    "Under --fsdp: rank `rank` dies by SIGKILL in its `n`-th sharded save, once its file is written, before the manifest."
    from fastai_resume.store import _Folder

    left, orig = [n], _Folder.finish

    def finish(*args, **kwargs):
        left[0] -= 1
        if int(os.environ["RANK"]) == rank and left[0] == 0:
            print(f"rank {rank}: SIGKILL in a save", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*args, **kwargs)

    _Folder.finish = finish  # type: ignore[method-assign]


def result(learn):
    rec = learn.recorder
    seen = next((c.seen for c in learn.cbs if isinstance(c, SeenItems)), {})
    return {
        "seen": {str(e): torch.tensor(v) for e, v in seen.items()},
        **model_state(learn),
        "losses": [float(l) for l in rec.losses],
        "lrs": [float(l) for l in rec.lrs],
        "values": [[float(v) for v in row] for row in rec.values],
    }


@contextlib.contextmanager
def shown_warnings():
    "Every warning given inside, printed as one 'WARNING: ' line each when it ends (also by an exception)."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in seen:
                print("WARNING: " + " ".join(str(w.message).split()), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--die-at", default=None, help="E,K: save after K training batches of epoch E, then die")
    ap.add_argument("--die-event", default="after_batch")
    ap.add_argument("--resume", default=None)
    ap.add_argument(
        "--resume-if-saved", action="store_true", help="--resume only where models/NAME.* exists (a node's own disk)"
    )
    ap.add_argument("--stall", default=None, help="R,S: rank R sleeps S seconds before training (a rank elsewhere)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--no-noise", action="store_true")
    ap.add_argument("--grad-acc", type=int, default=0)
    ap.add_argument("--trackers", action="store_true")
    ap.add_argument("--torch-opt", action="store_true")
    ap.add_argument("--method", default="fit_one_cycle")
    ap.add_argument("--auto", type=int, default=0, help="AutoCheckpoint every N iterations, with autoresume")
    ap.add_argument("--auto-seconds", type=float, default=None, help="AutoCheckpoint every_seconds")
    ap.add_argument("--auto-sync", action="store_true", help="AutoCheckpoint without background saves")
    ap.add_argument("--keep", type=int, default=2, help="AutoCheckpoint(keep=...)")
    ap.add_argument("--slow-ms", type=float, default=0, help="sleep this long per batch (to widen kill windows)")
    ap.add_argument("--ballast-mb", type=int, default=0, help="a constant buffer this big in the model (slower saves)")
    ap.add_argument("--fsize-mb", type=int, default=0, help="RLIMIT_FSIZE for this process (a full disk)")
    ap.add_argument("--on-error", default="raise")
    ap.add_argument("--remote", default=None, help="AutoCheckpoint(remote=URL): mirror the checkpoints there")
    ap.add_argument("--remote-wait", type=float, default=300.0, help="AutoCheckpoint(remote_wait=...)")
    ap.add_argument(
        "--show-warnings",
        action="store_true",
        help="record every warning (whatever the environment's filters) and print each at the end as 'WARNING: ...'",
    )
    ap.add_argument(
        "--ddp", action="store_true", help="train inside learn.distrib_ctx(cpu=True) (launch with torchrun)"
    )
    ap.add_argument(
        "--fsdp", action="store_true", help="train inside fastai_resume's fsdp_ctx(cpu=True) (launch with torchrun)"
    )
    ap.add_argument("--cuda", action="store_true", help="under --fsdp: on this rank's GPU (NCCL)")
    ap.add_argument("--bn", action="store_true", help="a model with BatchNorm and unevenly sharded rows")
    ap.add_argument(
        "--freeze", action="store_true", help="the first layer frozen (a fine-tune: its checkpoint a delta)"
    )
    ap.add_argument("--other-base", action="store_true", help="negative control: the frozen layer not the saved one's")
    ap.add_argument(
        "--make-full", default=None, help="NAME: write --resume's self-contained twin (make_full), then train"
    )
    ap.add_argument("--kill-in-save", default=None, help="R,N: under --fsdp rank R dies in its N-th save")
    ap.add_argument(
        "--dump-state",
        action="store_true",
        help="write the model and optimizer as saved (OUT.saved) or as loaded (OUT.start)",
    )
    ap.add_argument("--shared-buffers", action="store_true", help="negative control: rank 0's buffers on every rank")
    ap.add_argument("--start-epoch", type=int, default=0)
    ap.add_argument(
        "--shared-rng",
        action="store_true",
        help="negative control under --ddp: every rank resumes with rank 0's RNG state",
    )
    ap.add_argument(
        "--break-data-order",
        action="store_true",
        help="negative control: forget the saved DataLoader shuffling state on resume",
    )
    a = ap.parse_args(argv)
    cbs = []
    if a.grad_acc:
        cbs.append(GradientAccumulation(a.grad_acc))
    if a.auto or a.auto_seconds:
        cbs.append(
            fastai_resume.AutoCheckpoint(
                every_iters=a.auto or None,
                every_seconds=a.auto_seconds,
                keep=a.keep,
                background=not a.auto_sync,
                on_error=a.on_error,
                **(dict(remote=a.remote, remote_wait=a.remote_wait) if a.remote else {}),
            )
        )
    if a.fsize_mb:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (a.fsize_mb << 20, a.fsize_mb << 20))
    if a.slow_ms:
        cbs.append(Slow(a.slow_ms))
    if a.trackers:
        cbs += [
            SaveModelCallback(monitor="accuracy", fname="best", with_opt=True),
            EarlyStoppingCallback(monitor="valid_loss", patience=2),
        ]
    learn = build(a.path, nw=a.workers, noise=not a.no_noise, torch_opt=a.torch_opt, extra_cbs=cbs, bn=a.bn)
    if a.workers == 0:
        learn.add_cb(SeenItems(learn.dls.train))
    if a.freeze:
        learn.model[0].requires_grad_(False)
    if a.other_base:
        with torch.no_grad():
            learn.model[0].weight[0, 0] += 1.0
    if a.kill_in_save:
        kill_in_save(*map(int, a.kill_in_save.split(",")))
    if a.ddp or a.fsdp:  # ranks draw different augmentation noise and dropout masks: per-rank RNG matters
        import fastai.distributed  # noqa: F401  (defines Learner.distrib_ctx)

        rank = int(os.environ["RANK"])
        torch.manual_seed(1000 + rank)
        a.out = f"{a.out}.rank{rank}"
    if a.ballast_mb:
        learn.model.register_buffer("ballast", torch.ones(a.ballast_mb << 18))
    fit_cbs = []
    if a.die_at:
        e, k = map(int, a.die_at.split(","))
        fit_cbs.append(SaveAndDie(e, k, "crash", a.die_event, f"{a.out}.saved" if a.dump_state else None))
    if a.fsdp:
        ctx = fastai_resume.fsdp_ctx(learn, cpu=not a.cuda)
    elif a.ddp:
        ctx = learn.distrib_ctx(cpu=True)
    else:
        ctx = contextlib.nullcontext()
    with ctx:  # (the result inside: a sharded model is gathered by the process group)
        train(learn, a, fit_cbs)
        res = result(learn)
    fastai_resume.save(res, a.out)


def train(learn, a, fit_cbs):
    if a.stall and int(os.environ.get("RANK", 0)) == int(a.stall.split(",")[0]):
        time.sleep(float(a.stall.split(",")[1]))
    if a.make_full:
        models = learn.path / learn.model_dir
        fastai_resume.make_full(learn, models / f"{a.resume}.frk", models / f"{a.make_full}.frk")
        a.resume = a.make_full
    saved = a.resume and (not a.resume_if_saved or any((learn.path / learn.model_dir).glob(f"{a.resume}.*")))
    if saved:
        learn.load(a.resume)
        if a.dump_state:
            fastai_resume.save(model_state(learn), f"{a.out}.start")
        if a.break_data_order:
            train = fastai_resume.script.script(learn).armed.train
            train["loaders_epoch"] = [fastai_resume.loaders.capture(dl) for dl in learn.dls.loaders]
        if a.shared_rng:
            armed = fastai_resume.script.script(learn).armed
            armed.train["ranks"] = None
            if a.fsdp:  # each rank's file has its own: take rank 0's
                armed.train["rng"] = fastai_resume.dist.broadcast("negative control: rank 0's RNG", armed.train["rng"])
        if a.shared_buffers:  # negative control under --fsdp: rank 0's BatchNorm statistics on every rank
            import torch.distributed as D

            armed = fastai_resume.script.script(learn).armed  # (the resumed fit puts its model in)
            for name, _ in learn.model.named_buffers():
                if isinstance(armed.model.get(name), torch.Tensor):
                    D.broadcast(armed.model[name], 0)
    shown = shown_warnings() if a.show_warnings else contextlib.nullcontext()
    with shown, learn.no_bar():
        if a.method == "fit_one_cycle":
            learn.fit_one_cycle(a.epochs, 1e-2, cbs=fit_cbs, start_epoch=a.start_epoch)
        elif a.method == "fit_flat_cos":
            learn.fit_flat_cos(a.epochs, 1e-2, cbs=fit_cbs)
        elif a.method == "fit":
            learn.fit(a.epochs, 1e-3, cbs=fit_cbs)
        elif a.method == "fine_tune":
            learn.fine_tune(a.epochs, 1e-2, freeze_epochs=1, cbs=fit_cbs)
        elif a.method == "two_stages":  # two training calls of the script: stage 0's end is a file of its own
            learn.fit_one_cycle(1, 1e-2, cbs=fit_cbs)
            learn.fit_one_cycle(a.epochs, 1e-3, cbs=fit_cbs)


if __name__ == "__main__":
    main()
