"""What a rerun pays to pass the stages that finished before its checkpoint.

A script of k+1 stages (each a short fit_one_cycle of a model of about `--mb` MB of weights and Adam
state, a user's callback saving `crash` every 10 batches) is killed by SIGKILL in stage k and run
again with `learn.load('crash')` at the top. The rerun restores each skipped stage's end state (one
file load per stage, `fastai_resume.between`) before the resumed stage. Measured in the rerun, per
k: the time from the first stage call to the resumed stage's first trained batch (passing the k
stages), against one `fastai_resume.load` of a stage-end file (the cost of a load) and the load of
the checkpoint itself at the top. Interleaved rounds, medians with min-max.

    python bench/stages.py [--mb 400] [--stages 1,2,4] [--rounds 3]
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def child(a):
    "The training script (killed in stage `k`, or run again with `learn.load('crash')` at the top)."
    sys.path.insert(0, os.path.join(HERE, ".."))
    import fastai.callback.schedule  # noqa: F401
    import torch
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.torch_core import set_seed
    from torch import nn

    import fastai_resume as fr

    set_seed(0)
    width = int((a.mb * 2**20 / 12) ** 0.5)  # weights + two Adam moments, float32
    xs = torch.randn(640, width)
    items = list(zip(xs, xs[:, :1]))
    dls = DataLoaders(DataLoader(items, bs=32, shuffle=True), DataLoader(items[:64], bs=64), device="cpu")
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    t = {}

    class Marks(Callback):
        order = 100

        def after_batch(self):
            sc = fr.script.script(self.learn)
            if not self.training:
                return
            if "first" not in t and "start" in t:
                t["first"] = time.perf_counter()
            if self.learn.train_iter % 10 == 0:
                self.learn.save("crash", with_iter=True)
            if a.die and sc.stage.index == a.k and self.iter == 4:
                self.learn.save("crash", with_iter=True)
                os.kill(os.getpid(), signal.SIGKILL)

    learn = Learner(dls, model, loss_func=nn.MSELoss(), path=a.dir, cbs=Marks())
    if not a.die:
        t0 = time.perf_counter()
        learn.load("crash")
        print(f"LOAD_TOP {time.perf_counter() - t0:.4f}")
    t["start"] = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        for _ in range(a.k + 1):
            learn.fit_one_cycle(1, 1e-4)
    print(f"PASS {t['first'] - t['start']:.4f}")
    if a.k:
        end = os.path.join(a.dir, "models", "crash-s000-end.frk")
        t0 = time.perf_counter()
        fr.load(end)
        print(f"LOAD_END {time.perf_counter() - t0:.4f}")
        print(f"END_MB {os.path.getsize(end) / 2**20:.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "child"])
    ap.add_argument("--mb", type=float, default=400)
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--die", action="store_true")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    if a.cmd == "child":
        return child(a)
    ks = [int(k) for k in a.stages.split(",")]
    runs: dict = {k: {"pass": [], "load_end": [], "load_top": []} for k in ks}
    size = None
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    me = [sys.executable, os.path.abspath(__file__), "child", "--mb", str(a.mb)]
    for r in range(a.rounds):
        for k in ks:
            d = tempfile.mkdtemp(prefix="frk-stages-", dir=os.path.join(HERE, "results"))
            try:
                p = subprocess.run(me + ["--k", str(k), "--die", "--dir", d], capture_output=True, text=True, env=env)
                assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
                p = subprocess.run(me + ["--k", str(k), "--dir", d], capture_output=True, text=True, env=env)
                assert p.returncode == 0, p.stdout + p.stderr
                out = dict(line.split() for line in p.stdout.splitlines() if line[:4] in ("PASS", "LOAD", "END_"))
                assert p.stdout.count("restored as it ended") == k, p.stdout
                runs[k]["pass"].append(float(out["PASS"]))
                runs[k]["load_end"].append(float(out["LOAD_END"]))
                runs[k]["load_top"].append(float(out["LOAD_TOP"]))
                size = float(out["END_MB"])
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print(f"round {r + 1}/{a.rounds} k={k}: passing {runs[k]['pass'][-1]:.2f} s", flush=True)
    rows = {
        k: {
            "pass": common.stats(v["pass"]),
            "load_end": common.stats(v["load_end"]),
            "load_top": common.stats(v["load_top"]),
        }
        for k, v in runs.items()
    }
    print(f"\nA stage's end state: {size:.0f} MB. Times in seconds, medians (min-max) over {a.rounds} rounds.\n")
    print("| stages passed | passing them | per stage | one load of a stage end | per stage / one load |")
    print("|---|---|---|---|---|")
    for k, v in rows.items():
        p, le = v["pass"], v["load_end"]
        print(
            f"| {k} | {p['median']:.2f} ({p['min']:.2f}-{p['max']:.2f}) | {p['median'] / k:.2f} | "
            f"{le['median']:.2f} ({le['min']:.2f}-{le['max']:.2f}) | {p['median'] / k / le['median']:.2f}x |"
        )
    common.write("stages", {"machine": common.machine(), "end_mb": size, "rounds": a.rounds, "results": rows})


if __name__ == "__main__":
    main()
