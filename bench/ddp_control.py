"""What a data-parallel fit pays per batch for AutoCheckpoint's agreement (a SIGTERM seen by any
rank, a time-based save by rank 0's clock): one all-reduce of 8 int32 over gloo. Compared in the
same run with the all-reduce of a small model's gradients that DDP itself does every batch.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_control.py [--iters 2000]
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as D

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fastai_resume import dist  # noqa: E402


def per_call(f, iters):
    for _ in range(50):
        f()
    D.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ddp_control.json")
    )
    a = ap.parse_args()
    D.init_process_group("gloo")
    grads = torch.zeros(64 * 128 + 128 * 10 + 138)  # the test suite's digits MLP, as one bucket
    rows = {
        "agree_any_us": per_call(lambda: dist.agree_any(0), a.iters) * 1e6,
        "grad_allreduce_us": per_call(lambda: D.all_reduce(grads), a.iters) * 1e6,
    }
    if D.get_rank() == 0:
        print(
            f"AutoCheckpoint agreement: {rows['agree_any_us']:.1f} us per batch; "
            f"DDP's gradient all-reduce of a 9,610-parameter model: {rows['grad_allreduce_us']:.1f} us "
            f"({rows['agree_any_us'] / rows['grad_allreduce_us']:.2f}x)"
        )
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"world_size": D.get_world_size(), "iters": a.iters, **rows}, f, indent=1)
    D.destroy_process_group()


if __name__ == "__main__":
    main()
