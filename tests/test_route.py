"""The route a plain checkpoint takes through the package: `learn.save(name, with_iter=True)` and
`learn.load(name)` of a single process's learner pass through `store` (the one door to storage), never
through a module of sharded checkpoints, in a few stays.

A *stay* is a run of consecutive calls into one module along the route, counted with `sys.setprofile`:
each call of a package function that calls into another of the package's modules (or of `io`, which
writes and reads) starts a stay unless the previous one was in the same module; lookups (functions that
call nothing in another module: `dist.rank`, `paths.resolve`) are not stays. The issue that made `store`
measured 17 stays in 8 modules for the save before it (this count: through `sharded.commit_checkpoint` and
`checkpoint.commit`), 8 in 7 modules after: patches > between > store > checkpoint > frozen > state > io >
between."""

import sys

import torch
import torch.nn as nn
from fastai.data.core import DataLoaders
from fastai.learner import Learner

import fastai_resume  # noqa: F401  (the patches)

SHARDED = {"fastai_resume.sharded", "fastai_resume.shardfiles", "fastai_resume.dcp", "fastai_resume.fsdp"}


def route(fn) -> list:
    "The stays of `fn()`'s route through the package: [(module, the function that began the stay)]."
    nodes: list = []  # [module, function, calls another module]
    stack: list = []

    def prof(frame, event, arg):
        m = frame.f_globals.get("__name__", "")
        if not m.startswith("fastai_resume"):
            return
        if event == "call":
            if stack and nodes[stack[-1]][0] != m:
                nodes[stack[-1]][2] = True
            nodes.append([m, frame.f_code.co_name, False])
            stack.append(len(nodes) - 1)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    stays: list = []
    for m, f, crosses in nodes:
        if (crosses or m == "fastai_resume.io") and (not stays or stays[-1][0] != m):
            stays.append((m, f))
    return stays


def _learner(tmp_path):
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=8)
    learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), path=tmp_path)
    learn.fit(1)
    return learn


def _said(stays) -> str:
    return " > ".join(f"{m.split('.')[-1]}.{f}" for m, f in stays)


def test_a_plain_save_and_load_pass_through_store_in_a_few_stays_and_never_through_sharding(tmp_path):
    learn = _learner(tmp_path)
    save = route(lambda: learn.save("m", with_iter=True))
    assert (tmp_path / "models" / "m.frk").is_file()
    load = route(lambda: learn.load("m"))
    for stays in (save, load):
        assert not {m for m, _ in stays} & SHARDED, _said(stays)
        assert any(m == "fastai_resume.store" for m, _ in stays), _said(stays)
    assert len(save) <= 8, _said(save)
    assert len(load) <= 9, _said(load)
