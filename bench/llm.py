"""Fine-tuning an LLM with LoRA: what each checkpoint costs, ours against the Hugging Face Trainer's files.

The model is GPT-2 small's shape (12 layers, 768 wide, its 50,257-token vocabulary: 124 M parameters,
~500 MB of float32 weights, random from its config), written with `save_pretrained` and loaded with
`from_pretrained` as a user's script loads it; LoRA r=8 on `c_attn` from `peft`; fastai's Hugging Face
tutorial recipe around it (`Learner`, `LMDataLoader`, `DropOutput`), a few batches trained so Adam has
its moments. Then, at one batch boundary inside the fit, interleaved in each round:

- `ours`: `learn.save(name, with_iter=True)`: the trainable tensors, buffers, optimizer and training
  state, the frozen base by fingerprint (one CRC32C pass over it), written atomically and durably
  (fsync);
- `ours full`: the same with `full=True` (every tensor: what this package wrote before);
- `trainer`: the files the Hugging Face Trainer's `_save_checkpoint` writes for a LoRA run, by the
  same calls: the adapter through `save_pretrained` (safetensors), the optimizer state, the RNG states
  through `torch.save`, `trainer_state.json` (no fsync: the Trainer makes none);
- `trainer + fsync`: the same files, each fsynced (what a durable save adds).

Also: what the fingerprint pass alone costs (in a save, in a resume's load, and as each stage begins: a
resume pays the last two), against the base's `from_pretrained` load (the issue's target: the check at
most 10% of it); what a background snapshot holds in memory (the tensors of the tree it copies), delta
against full.

    python bench/llm.py [--rounds 7] [--layers 12]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the disk)")
    a = ap.parse_args()

    import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
    import torch
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.text.data import LMDataLoader
    from fastai.torch_core import set_seed
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    import fastai_resume as fr
    from fastai_resume import checkpoint, frozen

    work = tempfile.mkdtemp(prefix="frk-llm-", dir=a.dir or os.path.join(HERE, ".."))
    try:
        set_seed(0)
        base_dir = os.path.join(work, "base")
        GPT2LMHeadModel(GPT2Config(n_layer=a.layers)).save_pretrained(base_dir)
        loads = []
        for _ in range(3):  # the base's from_pretrained load, warm (the file in the page cache)
            t = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(base_dir)
            loads.append(time.perf_counter() - t)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM"))

        class DropOutput(Callback):
            def after_pred(self):
                self.learn.pred = self.pred[0]

        toks = torch.randint(0, model.config.vocab_size, (2 * 32 * 4 + 1,))
        dls = DataLoaders(LMDataLoader([toks], bs=2, seq_len=32), LMDataLoader([toks], bs=2, seq_len=32), device="cpu")
        times: dict = {k: [] for k in ("ours", "ours full", "trainer", "trainer + fsync", "fingerprints")}
        sizes: dict = {}
        snap: dict = {}

        class Measure(Callback):
            order = 100

            def after_batch(self):
                if not self.training or self.iter + 1 < self.n_iter:
                    return
                learn = self.learn
                held = {k: p for k, p in learn.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
                for r in range(a.rounds):
                    contenders = [
                        ("ours", lambda: learn.save("ours", with_iter=True)),
                        ("ours full", lambda: learn.save("full", with_iter=True, full=True)),
                        ("trainer", lambda: trainer_files(learn, os.path.join(work, "trainer"), False)),
                        ("trainer + fsync", lambda: trainer_files(learn, os.path.join(work, "trainer-s"), True)),
                        ("fingerprints", lambda: frozen.fingerprints(held)),
                    ]
                    for name, run in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                        t = time.perf_counter()
                        run()
                        times[name].append(time.perf_counter() - t)
                models = learn.path / learn.model_dir
                sizes["ours"] = os.path.getsize(models / f"ours{fr.EXT}")
                sizes["ours full"] = os.path.getsize(models / f"full{fr.EXT}")
                sizes["trainer"] = folder_bytes(os.path.join(work, "trainer"))
                sizes["base"] = sum(
                    p.numel() * p.element_size() for p in learn.model.parameters() if not p.requires_grad
                )
                snap["ours"] = tensor_bytes(checkpoint.build_tree(learn, with_iter=True))
                snap["ours full"] = tensor_bytes(checkpoint.build_tree(learn, with_iter=True, full=True))

        learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[DropOutput], path=work)
        with learn.no_bar(), learn.no_logging():
            learn.fit(1, 1e-3, cbs=Measure())

        checks, armed, stage_bases, resumes = [], [], [], []
        path = learn.path / learn.model_dir / f"ours{fr.EXT}"
        tree = fr.load(path)
        for _ in range(a.rounds):
            t = time.perf_counter()
            frozen.check(learn.model, tree, path)  # a plain load's (resume=False)
            checks.append(time.perf_counter() - t)
            t = time.perf_counter()
            frozen.not_yet(learn.model, tree)  # a load that arms a resume, at the top of a script
            armed.append(time.perf_counter() - t)
            t = time.perf_counter()
            frozen.stage_began(learn)  # what each stage's start costs (a resumed one's check is against it)
            stage_bases.append(time.perf_counter() - t)
            t = time.perf_counter()
            learn.load("ours", resume=False)
            resumes.append(time.perf_counter() - t)
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
            "check_s": common.stats(checks),
            "armed_check_s": common.stats(armed),
            "stage_base_s": common.stats(stage_bases),
            "load_s": common.stats(resumes),
            "from_pretrained_s": common.stats(loads),
        },
    )


if __name__ == "__main__":
    main()
