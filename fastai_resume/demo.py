"""The main job (`make demo`): train a real fastai model with AutoCheckpoint, kill it with SIGKILL
mid-epoch, run the same script again, and show that it resumed where it died and ended with the
weights of an uninterrupted run.

    python -m fastai_resume.demo [--dir DIR]          the whole story
    python -m fastai_resume.demo train --dir DIR      the user's training script alone

Data: scikit-learn's bundled handwritten digits (nothing is downloaded); scikit-learn comes with
the `demo` extra: `pip install 'fastai-resume[demo]'`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time


def train(folder: str, slow_ms: float) -> None:
    "The user's script: the only fastai_resume lines are the import and the callback."
    from fastai.vision.all import (  # what `from fastai.vision.all import *` gives a user's script
        Callback,
        CrossEntropyLossFlat,
        DataLoader,
        DataLoaders,
        Learner,
        accuracy,
        nn,
        set_seed,
        torch,
    )
    from sklearn.datasets import load_digits

    import fastai_resume

    class Heartbeat(Callback):
        "Prints each batch (so the demo knows where to kill) and paces the run."

        order = 150

        def after_batch(self):
            if self.training:
                print(f"@ epoch {self.epoch} batch {self.iter + 1}", flush=True)
                time.sleep(slow_ms / 1000)

    set_seed(0)
    X, y = load_digits(return_X_y=True)
    items = list(zip(torch.tensor(X / 16.0, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(y)))
    dls = DataLoaders(
        DataLoader(items[:1500], bs=32, shuffle=True, drop_last=True),
        DataLoader(items[1500:], bs=128),
        device="cpu",
        path=folder,
    )
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(32 * 64, 10),
    )
    learn = Learner(
        dls,
        model,
        loss_func=CrossEntropyLossFlat(),
        metrics=accuracy,
        path=folder,
        cbs=[fastai_resume.AutoCheckpoint(every_iters=10, keep=2), Heartbeat()],
    )
    with learn.no_bar():
        learn.fit_one_cycle(4, 3e-3)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in learn.model.state_dict().values())).hexdigest()
    print(f"FINAL-WEIGHTS-SHA256 {digest}", flush=True)


def _script(folder, slow_ms):
    return [sys.executable, "-m", "fastai_resume.demo", "train", "--dir", folder, "--slow-ms", str(slow_ms)]


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")


def _final_hash(out: str) -> str:
    return [l.split()[1] for l in out.splitlines() if l.startswith("FINAL-WEIGHTS-SHA256")][0]


def story(base: str, slow_ms: float, kill_at=(2, 20)) -> int:
    t_all = time.perf_counter()
    ref_dir, run_dir = os.path.join(base, "uninterrupted"), os.path.join(base, "crashing")
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    print("1. The uninterrupted run, for comparison ...", flush=True)
    ref = subprocess.run(_script(ref_dir, 0), capture_output=True, text=True, env=_env())
    if ref.returncode:
        sys.exit(ref.stdout + ref.stderr)
    print(f"   final weights sha256 {_final_hash(ref.stdout)[:16]}")

    print(
        f"2. The same script with AutoCheckpoint, killed with SIGKILL at epoch {kill_at[0]}, batch {kill_at[1]} ...",
        flush=True,
    )
    p = subprocess.Popen(
        _script(run_dir, slow_ms), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    marker = f"@ epoch {kill_at[0]} batch {kill_at[1]}"
    assert p.stdout is not None
    for line in p.stdout:
        if line.strip() == marker:
            p.kill()
            break
    p.wait()
    p.stdout.close()
    saved = sorted(f for f in os.listdir(os.path.join(run_dir, "models")) if f.endswith(".frk"))
    print(f"   killed (exit status {p.returncode}); checkpoints on disk: {', '.join(saved)}")

    print("3. The same script again: it finds the newest checkpoint and resumes ...", flush=True)
    t0 = time.perf_counter()
    again = subprocess.run(_script(run_dir, 0), capture_output=True, text=True, env=_env())
    if again.returncode:
        sys.exit(again.stdout + again.stderr)
    for line in again.stdout.splitlines():
        if line.startswith(("fastai_resume:", "AutoCheckpoint:")):
            print("   " + line)
    first = next((l for l in again.stdout.splitlines() if l.startswith("@ ")), "")
    print(
        f"   first batch trained after the restart: {first[2:]} (restart to the end: {time.perf_counter() - t0:.1f}s)"
    )

    h_ref, h_res = _final_hash(ref.stdout), _final_hash(again.stdout)
    same = h_ref == h_res
    print(
        f"4. final weights sha256: uninterrupted {h_ref[:16]}  killed+resumed {h_res[:16]}  -> "
        f"{'IDENTICAL' if same else 'DIFFERENT'}"
    )
    print(f"demo took {time.perf_counter() - t_all:.0f}s")
    return 0 if same else 1


def _require_sklearn() -> None:
    "The demo's data set comes with scikit-learn, which the package itself does not depend on."
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        sys.exit(
            "fastai_resume.demo needs scikit-learn (its bundled digits data set): pip install 'fastai-resume[demo]'"
        )


def main(argv=None):
    _require_sklearn()
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="story", choices=["story", "train"])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--slow-ms", type=float, default=20.0)
    a = ap.parse_args(argv)
    if a.cmd == "train":
        train(a.dir, a.slow_ms)
        return 0
    if a.dir:
        return story(a.dir, a.slow_ms)
    with tempfile.TemporaryDirectory(prefix="fastai-resume-demo-") as base:
        rc = story(base, a.slow_ms)
    print("(its files are gone with the temporary folder: --dir DIR keeps them)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
