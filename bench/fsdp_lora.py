"""A sharded (FSDP2) LoRA fine-tune's checkpoint: bytes per rank and save time, against the same run's full
sharded checkpoint and against torch.distributed.checkpoint (DCP) saving the trainable state.

2 ranks (gloo on the CPU, launched by torchrun); a GPT-2-shaped base written to a folder and loaded with
`from_pretrained`, LoRA from `peft` on `c_attn`, a fastai `Learner` in `fastai_resume.fsdp_ctx` (each GPT-2
block its own `fully_shard`), Adam's state made by one step. Each round saves, in turn:

- ours: `learn.save(name)` (what trains held, each rank its part; the frozen base by fingerprint: each rank
  checksums its own part of it);
- ours, full: `learn.save(name, full=True)` (every tensor: each rank its part of the base too);
- DCP: `dcp.save` of the trainable parameters' and the optimizer's state dicts (DTensors), what a DCP user
  would save of a LoRA run (the base reloaded from its files).

Every contender fsyncs what it writes. A figure is the slowest rank's time (what the job waits for), its
median over rounds; bytes are rank 0's files. The targets (issue): bytes at most 1.5x the trainable and
optimizer state's share, save at most 2x DCP's.

    python bench/fsdp_lora.py [--rounds 5] [--layers 8] [--width 512]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402
import report  # noqa: E402


def _bytes(tree) -> int:
    import torch

    from fastai_resume import dist

    n = 0
    for v in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(v, (dict, list, tuple)):
            n += _bytes(v)
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if dist.is_dtensor(v) else v
            n += t.numel() * t.element_size()
    return n


def worker(a):
    import torch
    import torch.distributed as D
    import torch.distributed.checkpoint as dcp
    from fastai.text.all import Callback, CrossEntropyLossFlat, DataLoaders, Learner
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import fastai_resume as fr

    os.chdir(a.dir)
    model = AutoModelForCausalLM.from_pretrained(a.base)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0))
    toks = torch.randint(0, 1000, (16, 33), generator=torch.Generator().manual_seed(0))
    ds = [(t[:-1], t[1:]) for t in toks]
    dls = DataLoaders.from_dsets(ds[:8], ds[8:], bs=2)

    class DropOutput(Callback):
        def after_pred(self):
            self.learn.pred = self.pred[0]

    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[DropOutput()], path=a.dir)
    with fr.fsdp_ctx(learn, cpu=True, shard=GPT2Block):
        rank = D.get_rank()
        with learn.no_bar(), learn.no_logging():
            learn.fit(1, 1e-3)  # Adam's state exists
        trainable = lambda: {  # noqa: E731
            k: v for k, v in learn.model.state_dict().items() if "lora_" in k
        }
        share = _bytes(trainable()) + _bytes(learn.opt.state_dict()["state"])
        clock = common.RankTimes(("ours", "ours_full", "dcp"))
        timed = clock.timed
        folder = os.path.join(a.dir, "dcp")
        for _ in range(a.rounds):
            timed("ours", lambda: learn.save("delta"))
            timed("ours_full", lambda: learn.save("full", full=True))
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            D.barrier()  # (the removal is not timed)
            timed("dcp", lambda: dcp.save({"model": trainable(), "opt": learn.opt.state_dict()}, checkpoint_id=folder))
        slowest = clock.slowest()
        if rank == 0:

            def rank0_file(name):
                d = os.path.join(a.dir, "models", f"{name}.frk")
                return os.path.getsize(os.path.join(d, fr.load(os.path.join(d, "manifest.frk"))["shards"][0]["file"]))

            dcp_rank0 = sum(
                os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith("__0_")
            )
            base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)  # (tied once)
            with open(a.out, "w") as f:
                json.dump(
                    {
                        "slowest": slowest,
                        "bytes_rank0": {"ours": rank0_file("delta"), "ours_full": rank0_file("full"), "dcp": dcp_rank0},
                        "trainable_and_opt_share": share,
                        "base_bytes": base,
                        "params": sum(p.numel() for p in model.parameters()),
                    },
                    f,
                )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where to write (default: a frk-fsdp-lora-* folder at the top)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tempfile.mkdtemp(prefix="frk-fsdp-lora-", dir=a.dir or os.path.join(HERE, ".."))
    try:
        machine = common.machine(d)
        base = os.path.join(d, "base")
        GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=8)).save_pretrained(base)
        args = ["--dir", d, "--base", base, "--rounds", str(a.rounds)]
        res = common.torchrun_worker(__file__, 2, args, os.path.join(d, "res.json"))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    payload = {
        "machine": machine,
        "rounds": a.rounds,
        "model": f"GPT-2-shaped, {a.layers} layers x {a.width}, {res['params'] / 1e6:.1f} M parameters",
        "world": 2,
        "save_s": {k: common.stats(v) for k, v in res["slowest"].items()},
        "bytes_rank0": res["bytes_rank0"],
        "trainable_and_opt_share": res["trainable_and_opt_share"],
        "base_bytes": res["base_bytes"],
    }
    report.publish("fsdp_lora", payload, a.json)


if __name__ == "__main__":
    main()
