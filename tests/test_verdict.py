"""One cross-rank verdict (`dist.verdict`): every rank's payload, or one error on every rank naming every
rank that failed. Two real processes launched by torchrun (gloo on the CPU) run the script below; each
rank prints what it got, and a save through `store` whose build fails on some ranks leaves the previous
checkpoint intact."""

import json
import os
import subprocess
import sys

from procs import ENV, HERE

SCRIPT = r"""
import errno, json, sys
from pathlib import Path
import torch, torch.nn as nn, torch.distributed as D
from fastai.data.core import DataLoaders
from fastai.learner import Learner
import fastai_resume
from fastai_resume import dist, store

D.init_process_group("gloo")
me = D.get_rank()
out = {}

def outcome(fn):
    try:
        return {"ok": fn()}
    except Exception as e:
        return {"raised": type(e).__name__, "msg": str(e), "notes": getattr(e, "__notes__", []),
                "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()}}

out["none"] = outcome(lambda: dist.verdict("none fails", None, me * 10))
out["one"] = outcome(lambda: dist.verdict("rank 1 fails", "its disk is gone" if me == 1 else None, me))
def both():
    own = OSError(errno.ENOSPC, "no room") if me == 0 else ValueError("a bad value")
    return dist.verdict("both fail", f"{type(own).__name__}: {own}", own=own)
out["both"] = outcome(both)

x = torch.randn(16, 4)
dls = DataLoaders.from_dsets(list(zip(x, x)), list(zip(x, x)), bs=4)
learn = Learner(dls, nn.Linear(4, 4), loss_func=nn.MSELoss(), path=Path(sys.argv[1]))
learn.create_opt()
path = Path(sys.argv[1]) / "models" / "m.frk"
store.save(learn, path, lambda: {"fastai_resume": 1, "model": {"w": torch.ones(2)}})
before = path.read_bytes()
def failing_build():
    if me == 1:
        raise RuntimeError("rank 1 cannot build its part")
    return {"fastai_resume": 1, "model": {"w": torch.zeros(2)}}
out["save"] = outcome(lambda: store.save(learn, path, failing_build))
out["intact"] = path.read_bytes() == before
Path(sys.argv[1], f"result.rank{me}.json").write_text(json.dumps(out))  # (not stdout: the ranks' lines interleave)
D.destroy_process_group()
"""


def test_every_rank_hears_one_verdict_naming_every_failing_rank(tmp_path):
    script = tmp_path / "verdict.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    p = subprocess.run(
        cmd + [str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(ENV, PYTHONPATH=os.path.dirname(HERE)),
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = {r: json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in (0, 1)}
    r0, r1 = got[0], got[1]
    assert r0["none"] == r1["none"] == {"ok": [0, 10]}
    for r in (r0, r1):  # the same error on both ranks, naming the one that failed
        assert r["one"]["raised"] == "RankFailures" and "rank 1: its disk is gone" in r["one"]["msg"], r["one"]
        assert r["one"]["failures"] == {"1": "its disk is gone"}
    # both failed: each raises its own exception (its type kept: a full disk is still an OSError), the other named
    assert r0["both"]["raised"] == "OSError" and "rank 1: ValueError: a bad value" in " ".join(r0["both"]["notes"])
    assert r1["both"]["raised"] == "ValueError" and "rank 0: OSError" in " ".join(r1["both"]["notes"])
    # a save whose build fails on rank 1: rank 0 hears it, names it, and the previous file is intact
    assert r1["save"]["raised"] == "RuntimeError"
    assert r0["save"]["raised"] == "RankFailures", r0["save"]
    assert "was not saved (rank 1: RuntimeError: rank 1 cannot build its part)" in r0["save"]["msg"]
    assert r0["intact"] and r1["intact"]
