"""What a data-parallel fit pays per batch for AutoCheckpoint's agreement (a SIGTERM seen by any
rank, a time-based save by rank 0's clock): one bounded step through the process group's store (dist.agree_any). Compared in the
same run with the all-reduce of a small model's gradients that DDP itself does every batch, in
interleaved rounds (medians with min-max; the ratio is paired by round).

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_control.py [--iters 2000] [--rounds 5]
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as D

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import common  # noqa: E402
import report  # noqa: E402

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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    D.init_process_group("gloo")
    machine = common.machine(HERE) if D.get_rank() == 0 else None
    grads = torch.zeros(64 * 128 + 128 * 10 + 138)  # the test suite's digits MLP, as one bucket
    agree, allreduce = [], []
    for _ in range(a.rounds):  # interleaved rounds: both calls meet the same load
        agree.append(per_call(lambda: dist.agree_any("bench", 0), a.iters) * 1e6)
        allreduce.append(per_call(lambda: D.all_reduce(grads), a.iters) * 1e6)
    if D.get_rank() == 0:
        payload = {
            "command": "python -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_control.py"
            + "".join(f" {x}" for x in sys.argv[1:]),
            "machine": machine,
            "rounds": a.rounds,
            "world_size": D.get_world_size(),
            "iters": a.iters,
            "agree_any_us": common.stats(agree),
            "grad_allreduce_us": common.stats(allreduce),
            "ratio": common.stats([x / y for x, y in zip(agree, allreduce)]),  # paired by round
        }
        report.publish("ddp_control", payload, a.json)
    D.destroy_process_group()


if __name__ == "__main__":
    main()
