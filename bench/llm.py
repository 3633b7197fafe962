"""Fine-tuning an LLM with LoRA: what each checkpoint costs, ours against the Hugging Face Trainer's files.

The model is GPT-2 small's shape (12 layers, 768 wide, its 50,257-token vocabulary: 124 M parameters,
~500 MB of float32 weights, random from its config), written with `save_pretrained` and loaded with
`from_pretrained` as a user's script loads it; LoRA r=8 on `c_attn` from `peft`; fastai's Hugging Face
tutorial recipe around it (`Learner`, `LMDataLoader`, `DropOutput`), a few batches trained so Adam has
its moments. Then, at one batch boundary inside the fit, interleaved in each round:

- `ours`: `learn.save(name, with_iter=True)`: the trainable tensors, buffers, optimizer and training
  state, the frozen base by fingerprint, written atomically and durably (fsync). The base's pages are
  still the safetensors file's (nothing wrote them), so its CRC32Cs are those read before
  (`fastai_resume.provenance`): the save reads the kernel's page table, not the weights;
- `ours unmapped`: the same where the base is not a file's pages (a copy: another dtype, a GPU): the
  CRC32C pass reads every frozen byte;
- `ours full`: the same with `full=True` (every tensor: what this package wrote before);
- `trainer`: the files the Hugging Face Trainer's `_save_checkpoint` writes for a LoRA run, by the
  same calls: the adapter through `save_pretrained` (safetensors), the optimizer state, the RNG states
  through `torch.save`, `trainer_state.json` (no fsync: the Trainer makes none);
- `trainer + fsync`: the same files, each fsynced (what a durable save adds).

Then the same learner with its base a bf16 copy (`.to(torch.bfloat16)`: anonymous memory, not the file's
pages), as a user fine-tunes in bf16: `bf16 ours` (the base proven unwritten by the kernel's write protection,
`fastai_resume.unwritten`: read once, not at each save), `bf16 ours, read` (the same with that off: the pass
reads every frozen byte at each save, as before), `bf16 trainer`, `bf16 trainer + fsync`, and the fingerprints
alone both ways (`bf16 fingerprints`, `bf16 pass`). The issue's target: `bf16 ours` at most 2x `bf16 trainer`.

Also: the fingerprints alone, both ways (`fingerprints`, `pass`); what a background snapshot holds in
memory (the tensors of the tree it copies), delta against full; and what a resume adds, in a new
process per round as a rerun meets it (`probe`: the base just loaded by `from_pretrained`), against
that `from_pretrained` load (the issue's target: at most 10% of it): on this machine, and on one that
never read the base (the folder of remembered CRCs not used).

    python bench/llm.py [--rounds 7] [--layers 12]
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
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
import common  # noqa: E402


def folder_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def fsync_folder(d):
    for r, _, fs in os.walk(d):
        for f in fs:
            fd = os.open(os.path.join(r, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def trainer_files(learn, d, fsync):
    "What the Trainer's `_save_checkpoint` writes for a peft model: adapter, optimizer, RNG, trainer state."
    import random

    import numpy as np
    import torch

    os.makedirs(d, exist_ok=True)
    learn.model.save_pretrained(d)
    torch.save(learn.opt.state_dict(), os.path.join(d, "optimizer.pt"))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, os.path.join(d, "rng_state.pth"))
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"global_step": learn.train_iter, "epoch": learn.epoch, "log_history": []}, f)
    if fsync:
        fsync_folder(d)


def tensor_bytes(tree) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def learner(base_dir, work, bs=2, seq_len=32, n_batches=4, valid_batches=None, dtype=None):
    """The tutorial's learner on the base as a user's script builds it: `from_pretrained`, LoRA, `Learner`;
    `n_batches` training batches of `bs` x `seq_len` random tokens, validated on the first `valid_batches`
    (all of them by default). `dtype`: the base copied to it first (`model.to(dtype)`)."""
    import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
    import torch
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.text.data import LMDataLoader
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if dtype is not None:
        model = model.to(dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM"))

    class DropOutput(Callback):
        def after_pred(self):
            self.learn.pred = self.pred[0].float()  # (a bf16 model's logits: the loss in float, as AMP computes it)

    toks = torch.randint(0, model.config.vocab_size, (bs * seq_len * n_batches + 1,))
    valid = toks if valid_batches is None else toks[: bs * seq_len * valid_batches + 1]
    dls = DataLoaders(
        LMDataLoader([toks], bs=bs, seq_len=seq_len), LMDataLoader([valid], bs=bs, seq_len=seq_len), device="cpu"
    )
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[DropOutput], path=work)


def probe(work):
    """What a resume adds, in a new process as a rerun meets it (the base just loaded by `from_pretrained`,
    nothing trained yet): printed as JSON, seconds. On this machine (the regions' CRCs in the folder), then
    as on one that never read the base (its replacement after a lost machine): the folder not used."""

    from transformers import AutoModelForCausalLM

    import fastai_resume as fr
    from fastai_resume import frozen, provenance

    base_dir = os.path.join(work, "base")
    AutoModelForCausalLM.from_pretrained(base_dir)  # (the first also imports the model's code)
    loads = []
    for _ in range(3):  # what the check is held against (warm: the file in the page cache)
        t = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(base_dir)
        loads.append(time.perf_counter() - t)
    out = {"from_pretrained": statistics.median(loads)}
    learn = learner(base_dir, work)
    path = learn.path / learn.model_dir / f"ours{fr.EXT}"
    tree = fr.load(path)
    runs = {
        "stage": lambda: frozen.stage_began(learn),  # AutoCheckpoint's: the stage's start, checked against
        "hand": lambda: (frozen.not_yet(learn.model, tree), frozen.stage_began(learn)),  # `learn.load` atop
        "check": lambda: frozen.check(learn.model, tree, path),  # a plain load's (resume=False)
        "load": lambda: learn.load("ours", resume=False),  # the whole load of the delta file
    }
    for cold in (False, True):
        for k, run in runs.items():
            if cold and k == "load":
                continue
            took = []
            for _ in range(5):  # (the first of each also runs its code's first time: imports)
                provenance.forget()  # this process knows only the folder's
                with mock.patch.dict(os.environ, {provenance.ENV: ""} if cold else {}):
                    t = time.perf_counter()
                    run()
                    took.append(time.perf_counter() - t)
            out[("cold " if cold else "") + k] = statistics.median(took)
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the disk)")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # (a resume's new process: `probe`)
    a = ap.parse_args()
    if a.probe:
        return probe(a.probe)

    from fastai.callback.core import Callback
    from fastai.torch_core import set_seed
    from transformers import GPT2Config, GPT2LMHeadModel

    import fastai_resume as fr
    from fastai_resume import checkpoint, frozen, provenance, unwritten

    def unmapped(run):
        "`run` as where the frozen weights are not a file's pages (a copy, a GPU): the pass reads every byte."
        with mock.patch.object(provenance, "keys", lambda tensors: {}):
            return run()

    def untracked(run):
        "`run` without the kernel's write protection (`unwritten`): every byte that is not a file's is read."
        with mock.patch.object(unwritten, "crcs", lambda tensors, read: dict(zip(tensors, read(list(tensors))))):
            return run()

    work = tempfile.mkdtemp(prefix="frk-llm-", dir=a.dir or os.path.join(HERE, ".."))
    try:
        set_seed(0)
        base_dir = os.path.join(work, "base")
        GPT2LMHeadModel(GPT2Config(n_layer=a.layers)).save_pretrained(base_dir)
        time.sleep(provenance._SETTLED_NS / 1e9)  # a base downloaded before the run, as users' are,
        for name in os.listdir(base_dir):  # and out of the page cache: what the load maps, it reads
            fd = os.open(os.path.join(base_dir, name), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        learn = learner(base_dir, work)
        names = ("ours", "ours unmapped", "ours full", "trainer", "trainer + fsync", "fingerprints", "pass")
        names += ("bf16 ours", "bf16 ours, read", "bf16 trainer", "bf16 trainer + fsync", "bf16 fingerprints")
        names += ("bf16 pass",)
        times: dict = {k: [] for k in names}
        sizes: dict = {}
        snap: dict = {}

        class Measure(Callback):
            order = 100

            def __init__(self, bf16=False):
                self.bf16 = bf16

            def after_batch(self):
                if not self.training or self.iter + 1 < self.n_iter:
                    return
                learn = self.learn
                held = {k: p for k, p in learn.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
                trainer = lambda d, fsync: lambda: trainer_files(learn, os.path.join(work, d), fsync)  # noqa: E731
                if self.bf16:
                    contenders = [
                        ("bf16 ours", lambda: learn.save("ours-b", with_iter=True)),
                        ("bf16 ours, read", lambda: untracked(lambda: learn.save("ours-br", with_iter=True))),
                        ("bf16 trainer", trainer("trainer-b", False)),
                        ("bf16 trainer + fsync", trainer("trainer-bs", True)),
                        ("bf16 fingerprints", lambda: frozen.fingerprints(held)),
                        ("bf16 pass", lambda: untracked(lambda: frozen.fingerprints(held))),
                    ]
                else:
                    contenders = [
                        ("ours", lambda: learn.save("ours", with_iter=True)),
                        ("ours unmapped", lambda: unmapped(lambda: learn.save("ours-u", with_iter=True))),
                        ("ours full", lambda: learn.save("full", with_iter=True, full=True)),
                        ("trainer", trainer("trainer", False)),
                        ("trainer + fsync", trainer("trainer-s", True)),
                        ("fingerprints", lambda: frozen.fingerprints(held)),
                        ("pass", lambda: unmapped(lambda: frozen.fingerprints(held))),
                    ]
                for r in range(a.rounds):
                    for name, run in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                        t = time.perf_counter()
                        run()
                        times[name].append(time.perf_counter() - t)
                if self.bf16:
                    models = learn.path / learn.model_dir
                    sizes["bf16 ours"] = os.path.getsize(models / f"ours-b{fr.EXT}")
                    sizes["bf16 trainer"] = folder_bytes(os.path.join(work, "trainer-b"))
                    sizes["bf16 base"] = sum(
                        p.numel() * p.element_size() for p in learn.model.parameters() if not p.requires_grad
                    )
                    sizes["bf16 tracking"] = unwritten.available()
                    return
                models = learn.path / learn.model_dir
                sizes["ours"] = os.path.getsize(models / f"ours{fr.EXT}")
                sizes["ours full"] = os.path.getsize(models / f"full{fr.EXT}")
                sizes["trainer"] = folder_bytes(os.path.join(work, "trainer"))
                sizes["base"] = sum(
                    p.numel() * p.element_size() for p in learn.model.parameters() if not p.requires_grad
                )
                snap["ours"] = tensor_bytes(checkpoint.build_tree(learn, with_iter=True))
                snap["ours full"] = tensor_bytes(checkpoint.build_tree(learn, with_iter=True, full=True))

        with learn.no_bar(), learn.no_logging():
            learn.fit(1, 1e-3, cbs=Measure())
        import torch

        copy = learner(base_dir, work, dtype=torch.bfloat16)  # (a new learner: its own models' files)
        with copy.no_bar(), copy.no_logging():
            copy.fit(1, 1e-3, cbs=Measure(bf16=True))
        probes = []
        for _ in range(a.rounds):  # each a new process, as a rerun is
            run = subprocess.run([sys.executable, __file__, "--probe", work], capture_output=True, text=True)
            if run.returncode:
                sys.exit(run.stdout + run.stderr)
            probes.append(json.loads(run.stdout.strip().splitlines()[-1]))
        machine = common.machine(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import report

    report.publish(
        "llm",
        {
            "machine": machine,
            "rounds": a.rounds,
            "model": f"GPT-2 small's shape ({a.layers} layers, 768 wide), LoRA r=8 on c_attn",
            "bytes": sizes,
            "snapshot_bytes": snap,
            "save_s": {k: common.stats(v) for k, v in times.items()},
            "resume_s": {k: common.stats([p[k] for p in probes]) for k in probes[0]},
        },
    )


if __name__ == "__main__":
    main()
