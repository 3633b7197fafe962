"""A LoRA fine-tune of a `transformers` causal LM sharded with FSDP2, as a fine-tuner runs one: the base
written to a folder and loaded with `from_pretrained`, adapters from `peft`, a fastai `Learner` in
`fastai_resume.fsdp_ctx` (each GPT-2 block its own `fully_shard`), launched by torchrun (gloo on the CPU).

    torchrun --nproc_per_node 2 tests/fsdp_lora.py --path D --out OUT [--die-at K] [--resume NAME]
    python tests/fsdp_lora.py --path D --out OUT --plain --resume NAME   (one process, the model not sharded)

`--die-at K`: saves `crash` (with_iter=True) after K training batches of the first epoch, then SIGKILLs
itself. `--auto N [--remote URL]`: AutoCheckpoint every N batches (mirrored to URL), with autoresume. `--base-seed S`: another base (negative control). Each rank writes OUT.rank{r}: its losses and
every parameter whole (gathered)."""

import argparse
import os
import signal
import sys
import time

import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import fastai_resume  # noqa: E402


def base_model(folder, seed):
    "The 'pretrained' base: a small GPT-2 config's random weights, written once (rank 0) and read by every rank."
    from transformers import GPT2Config, GPT2LMHeadModel

    mark = os.path.join(folder, f"seed-{seed}")
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not os.path.exists(mark):  # (each node's disk its copy)
        torch.manual_seed(seed)
        cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        GPT2LMHeadModel(cfg).save_pretrained(folder)
        open(mark, "w").close()
    while not os.path.exists(mark):
        time.sleep(0.05)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--base-seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true", help="one process, the model not sharded")
    ap.add_argument("--auto", type=int, default=0, help="AutoCheckpoint(every_iters=N, keep=3)")
    ap.add_argument("--remote", default=None, help="... mirrored to this URL")
    ap.add_argument("--slow-ms", type=float, default=0, help="sleep this long after each batch")
    a = ap.parse_args(argv)
    from fastai.text.all import Callback, CrossEntropyLossFlat, DataLoaders, Learner
    from fastai.torch_core import set_seed
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    os.chdir(a.path)
    base = os.path.join(a.path, f"base-{a.base_seed}")
    base_model(base, a.base_seed)
    set_seed(42)
    model = AutoModelForCausalLM.from_pretrained(base)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1))
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 64, (96, 17), generator=g)
    ds = [(t[:-1], t[1:]) for t in toks]
    dls = DataLoaders.from_dsets(ds[:80], ds[80:], bs=4)

    class DropOutput(Callback):
        def after_pred(self):
            self.learn.pred = self.pred[0]

    class SaveAndDie(Callback):
        def after_batch(self):
            if self.training and self.epoch == 0 and self.iter + 1 == a.die_at:
                self.learn.save("crash", with_iter=True)
                os.kill(os.getpid(), signal.SIGKILL)

    class Slow(Callback):
        def after_batch(self):
            time.sleep(a.slow_ms / 1000)

    cbs = [DropOutput] + ([Slow()] if a.slow_ms else [])
    if a.auto:
        cbs.append(fastai_resume.AutoCheckpoint(every_iters=a.auto, keep=3, remote=a.remote))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=cbs)
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(1000 + rank)  # each rank its own dropout masks
    if a.plain:
        import contextlib

        ctx = contextlib.nullcontext()
    else:
        ctx = fastai_resume.fsdp_ctx(learn, cpu=True, shard=GPT2Block)
    with ctx, learn.no_bar():
        if a.resume:
            learn.load(a.resume)
        learn.fit(2, 3e-3, cbs=[SaveAndDie()] if a.die_at else [])
        params = {
            k: (p.full_tensor() if fastai_resume.dist.is_dtensor(p) else p).detach().clone()
            for k, p in learn.model.named_parameters()
        }
    losses = torch.stack([torch.as_tensor(x) for x in learn.recorder.losses])
    fastai_resume.save({"losses": losses, "params": params}, f"{a.out}.rank{rank}")


if __name__ == "__main__":
    main()
