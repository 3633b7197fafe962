"""A sharded (FSDP2) checkpoint's save and load against torch's DCP (torch.distributed.checkpoint) on the same
model and optimizer state, at 1, 2 and 4 processes (gloo on the CPU, launched by torchrun), both ways:

- a fixed model ("same model"): each rank holds 1/N of it, so each rank's cost should fall with N;
- a fixed share per rank ("same share"): the model grows with N, so each rank's cost should stay flat.

Ours: `learn.save(name)` / `learn.load(name)` inside `fastai_resume.fsdp_ctx` (each rank writes and reads its
own file, rank 0 commits the manifest). DCP: `dcp.save` / `dcp.load` of the same `{'model', 'opt'}` state
dicts (DTensors), then the same `load_state_dict` calls. Both fsync what they write. A round times each of
the four in turn; a figure is the slowest rank's time (what the job waits for), its median over rounds.

    python bench/sharded.py [--rounds 3] [--worlds 1,2,4] [--width 1024] [--dir DIR]
    python -m torch.distributed.run --standalone --nproc_per_node N bench/sharded.py --worker ...  (one size)
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


def worker(a):
    import torch
    import torch.distributed as D
    import torch.distributed.checkpoint as dcp
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from torch import nn

    import fastai_resume as fr

    D.init_process_group("gloo")
    world, rank = D.get_world_size(), D.get_rank()
    layers = a.layers * (world if a.share else 1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(layers)])
    xs = torch.randn(8, a.width)
    dls = DataLoaders(DataLoader(list(zip(xs, xs)), bs=4), DataLoader(list(zip(xs, xs)), bs=4), device="cpu")
    learn = Learner(dls, model, loss_func=nn.MSELoss(), path=a.dir)
    with fr.fsdp_ctx(learn, cpu=True):
        learn.create_opt()
        learn.model(xs).square().mean().backward()  # Adam's state exists once it has stepped
        learn.opt.step()
        learn.opt.zero_grad()
        clock = common.RankTimes(("ours_save", "ours_load", "dcp_save", "dcp_load"))
        timed = clock.timed
        folder = os.path.join(a.dir, "dcp")

        def dcp_save():
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            D.barrier()  # (the removal is not timed: a round's first save found no folder either)
            timed(
                "dcp_save",
                lambda: dcp.save(
                    {"model": learn.model.state_dict(), "opt": learn.opt.state_dict()}, checkpoint_id=folder
                ),
            )

        def dcp_load():
            sd = {"model": learn.model.state_dict(), "opt": learn.opt.state_dict()}
            dcp.load(sd, checkpoint_id=folder)
            learn.model.load_state_dict(sd["model"])
            learn.opt.load_state_dict(sd["opt"])

        for _ in range(a.rounds):
            timed("ours_save", lambda: learn.save("bench"))
            timed("ours_load", lambda: learn.load("bench"))
            dcp_save()
            timed("dcp_load", dcp_load)
        slowest = clock.slowest()  # each rank's times: the job waits for the slowest
        if rank == 0:
            per_rank = os.path.getsize(
                os.path.join(
                    a.dir,
                    "models",
                    "bench.frk",
                    fr.load(os.path.join(a.dir, "models", "bench.frk", "manifest.frk"))["shards"][0]["file"],
                )
            )
            with open(a.out, "w") as f:
                json.dump({"world": world, "layers": layers, "file_bytes_rank0": per_rank, "slowest": slowest}, f)


def run(a, world, share):
    d = tempfile.mkdtemp(prefix="frk-sharded-", dir=a.dir)
    args = ["--dir", d, "--rounds", str(a.rounds), "--width", str(a.width), "--layers", str(a.layers)]
    res = common.torchrun_worker(__file__, world, args + (["--share"] if share else []), os.path.join(d, "res.json"))
    shutil.rmtree(d, ignore_errors=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--width", type=int, default=1024, help="each Linear layer is width x width (fp32)")
    ap.add_argument("--layers", type=int, default=6, help="layers of the fixed model; per rank for the fixed share")
    ap.add_argument("--dir", default=None, help="where to write (default bench/results/sharded-tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    a.dir = a.dir or os.path.join(HERE, "results", "sharded-tmp")
    os.makedirs(a.dir, exist_ok=True)
    machine = common.machine(a.dir)
    rows = []
    for share in (False, True):
        for world in map(int, a.worlds.split(",")):
            res = run(a, world, share)
            rows.append(
                {
                    "scaling": "same share" if share else "same model",
                    "world": world,
                    "layers": res["layers"],
                    "state_bytes": res["layers"]
                    * (a.width**2 + a.width)
                    * 4
                    * 3,  # fp32 parameters, Adam's two moments
                    "file_bytes_rank0": res["file_bytes_rank0"],
                    **{k: common.stats(v) for k, v in res["slowest"].items()},
                }
            )
            print(
                f"{rows[-1]['scaling']:10s} world {world}: "
                + ", ".join(
                    f"{k} {rows[-1][k]['median']:.3f}s" for k in ("ours_save", "ours_load", "dcp_save", "dcp_load")
                ),
                flush=True,
            )
    shutil.rmtree(a.dir, ignore_errors=True) if a.dir.endswith("sharded-tmp") else None
    payload = {"machine": machine, "rounds": a.rounds, "width": a.width, "layers": a.layers, "rows": rows}
    report.publish("sharded", payload, a.json)


if __name__ == "__main__":
    main()
