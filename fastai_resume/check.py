"""`fastai-resume check SCRIPT [ARGS...]`: does this training script resume exactly? Find out before a
long run.

It runs the user's own script, each time in a new process, with every epoch cut to its first
`batches` training and validation batches (the same cut in every run, so the runs stay comparable and
short): once uninterrupted; once saved and killed by SIGKILL at a batch of a late stage's second epoch;
once more from that checkpoint, loaded at the top as `learn.load` does, with the end states of the
stages before it (as after stages that saved resumable checkpoints, `AutoCheckpoint`'s way); and, where
stages come before the killed one, once more without them (as after stages that saved nothing
resumable, the manual way). A probe in every fit records, for each training batch, digests of the RNG
states and of the model and optimizer before it, of its data, its loss, and of the model and optimizer
after it. The first record where a resumed run differs from the uninterrupted one is reported with its
likely cause (a between-stage load, where the resumed stage did not start from the checkpoint's state).

While checking, `AutoCheckpoint` neither saves nor resumes (the check tests the same save and resume
with a checkpoint of its own, `fastai_resume_check.frk`, removed afterwards).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import datalog, loaders, stored
from .script import BETWEEN_HOOKS, CHECK_ENV, DISARM_HOOKS, FIT_HOOKS, STAGE_BEGIN_HOOKS, script

__all__ = ["check", "CheckResult", "ENV", "probe_for"]

ENV = CHECK_ENV  # "record", "kill:S,E,I", "resume" or "resume-bare"; with ENV_TRACE, ENV_BATCHES
ENV_TRACE, ENV_BATCHES = "FASTAI_RESUME_CHECK_TRACE", "FASTAI_RESUME_CHECK_BATCHES"
ENV_DIR = "FASTAI_RESUME_CHECK_DIR"  # where the runs keep their stages' end states (removed afterwards)
CKPT = "fastai_resume_check"


def _rng_digest() -> int:
    return datalog.text_digest(
        (
            datalog.text_digest(random.getstate()),
            datalog.fingerprint(torch.from_numpy(np.random.get_state()[1].copy())),  # type: ignore[index]
            datalog.fingerprint(torch.get_rng_state()),
        )
    )


def _append(rec: dict) -> None:
    if os.environ.get(ENV) and os.environ.get(ENV_TRACE):
        with open(os.environ[ENV_TRACE], "a") as f:
            f.write(json.dumps(rec) + "\n")


def note_disarm(why: str) -> None:
    "Under `fastai-resume check`: a cancelled resume goes into the trace (the likely cause of what follows)."
    _append({"disarm": why})


def _stage_begins(learn, stage) -> None:
    """Under `fastai-resume check`: the resumed run loads the check's checkpoint at its first stage, and
    every run keeps each stage's end state in the check's own folder (removed with it)."""
    if not os.environ.get(ENV):
        return
    mode = os.environ[ENV]
    if mode.startswith("resume") and stage.index == 0 and script(learn).armed is None:
        learn.load(CKPT)
        armed = script(learn).armed
        if armed is not None and mode == "resume-bare":
            armed.ends = []  # as after stages that saved nothing resumable: their end states are not had
    if os.environ.get(ENV_DIR):
        stage.saved_in(Path(os.environ[ENV_DIR]), CKPT, auto=True)


DISARM_HOOKS.append(note_disarm)
STAGE_BEGIN_HOOKS.append(_stage_begins)


def digest(v) -> int:
    "A digest of a value tree (tensors by their bytes), the same in every process."
    return datalog.fingerprint(v)


def note_between(at: int, op: str, file, digest) -> None:
    "Under `fastai-resume check`: a between-stage call and the digest of what it wrote, read or returned."
    _append({"between": [at, op, file, digest]})


def _model_opt(learn) -> list:
    "Digests of the model's state and the optimizer's."
    sd = learn.opt.state_dict()
    return [
        datalog.fingerprint(list(learn.model.state_dict().values())),
        datalog.fingerprint(sd["state"] if isinstance(sd, dict) else []),
    ]


def probe_for(learn):
    "The check's probe callback for a fit of `learn`, if this process runs under `fastai-resume check`."
    mode = os.environ.get(ENV)
    if not mode:
        return None
    from fastai.callback.core import Callback, CancelTrainException, CancelValidException

    class CheckProbe(Callback):
        "Cuts epochs, records digests per training batch, and saves and dies where told."

        order = 300

        def before_fit(self):
            _append({"loader": loaders.describe(self.dls.train)})

        def before_batch(self):
            if not self.training:
                return
            self.pre = {
                "rng": _rng_digest(),
                "data": datalog.fingerprint(list(self.xb) + list(self.yb)),
                "in": _model_opt(self.learn),
            }

        def after_batch(self):
            n = int(os.environ.get(ENV_BATCHES, "8"))
            if not self.training:
                if self.iter + 1 >= n:
                    raise CancelValidException()
                return
            sc = script(self.learn)
            key = [sc.stage.index, sc.session.fit_index, self.epoch, self.iter]
            model, opt = _model_opt(self.learn)
            rec = {"key": key, **self.pre, "loss": float(self.loss), "model": model, "opt": opt}
            with open(os.environ[ENV_TRACE], "a") as f:
                f.write(json.dumps(rec) + "\n")
            if (
                mode.startswith("kill:")
                and key[0] == int(mode[5:].split(",")[0])
                and [self.epoch, self.iter + 1] == [int(x) for x in mode[5:].split(",")[1:]]
            ):
                _append({"ckpt": str(self.learn.save(CKPT, with_iter=True))})  # removed by the check
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if self.iter + 1 >= n:
                raise CancelTrainException()

    return CheckProbe()


@dataclass
class CheckResult:
    ok: bool
    message: str
    kill_at: tuple | None


_CAUSES = {
    "in": "the model or optimizer this batch started from differs: something between the checkpoint's load and "
    "the resumed fit changed them, and the fit trained on from there",
    "rng": "the RNG state before this batch differs: something drew random numbers that the checkpoint does not "
    "restore (a callback's before_batch, a transform outside the DataLoader, a stream or sampler with its own "
    "generator that has no state_dict)",
    "data": "this batch's data differs: the loader's order or its random transforms are not restored (a custom "
    "DataLoader or sampler keeping order state outside state_dict(), a stream without state_dict(), random "
    "transforms in a PyTorch DataLoader's worker processes)",
    "loss": "same data and RNG but another loss: model state outside the state dict (a buffer kept as a plain "
    "attribute, a recurrent model's hidden state fastai_resume does not know)",
    "model": "same data, RNG and loss but another model after the step: optimizer or gradient state outside the "
    "checkpoint (a custom optimizer's attributes, a callback changing the step without resume_state())",
    "opt": "the optimizer state after the step differs: a custom optimizer or callback state not saved (give the "
    "callback resume_state()/load_resume_state())",
}


def _stream_cause(stream: dict, later_epoch: bool) -> str:
    "Why a resumed stream (`loaders.describe`) gave other data: the causes told apart by where, and what the stream is."
    name = stream.get("name", "the stream")
    if later_epoch:
        return (
            f"a loaded state that sticks: the resumed epoch was right, but a later epoch of the stream ({name}) did "
            "not start where the uninterrupted run's did: its load_state_dict() applies to every later pass, not "
            "only the next one (forget the loaded state once a pass has begun)"
        )
    if stream.get("workers"):
        return (
            f"a state that lives in other processes: the stream ({name}) is read by {stream['workers']} worker "
            "processes, each with its own copy; the copy whose state_dict() the checkpoint took never moved "
            "(torchdata's StatefulDataLoader collects each worker's state)"
        )
    if stream.get("partial"):
        return f"a state that does not hold everything: the stream ({name}) {stream['partial']}"
    return (
        f"the stream's ({name}) loaded state does not put it back where it was: its state_dict() leaves part "
        "of its position out, or its load_state_dict() does not apply it"
    )


def _trace(path) -> tuple:
    "The batches' records by key, the between-stage calls in order, the cancelled resumes, the first fit's loader."
    out, between, disarms, loader = {}, [], [], None
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if "loader" in r:
                loader = loader or r["loader"]  # (the first fit's training loader: the resumed one's)
            elif "between" in r:
                between.append(r["between"])
            elif "disarm" in r:
                disarms.append(r["disarm"])
            elif "key" in r:
                out[tuple(r["key"])] = r
    return out, between, disarms, loader


def _where(at: int, op: str) -> str:
    if op == "stage":
        return f"at the end of stage {at}"
    return f"after stage {at - 1}" if at else "before stage 0"


def _first_between_difference(ref: list, res: list) -> str | None:
    "What the first between-stage call (save, load, validate, lr_find, export, a stage's numbers) that differs is."
    for want, got in zip(ref, res):
        if want != got:
            at, op, file, _ = want
            return (
                f"between stages ({_where(at, op)}): {op}{' of ' + file if file else ''} differs from the "
                f"uninterrupted run's ({got[1]}{' of ' + got[2] if got[2] else ''} in the resumed run): what the "
                "script reads or writes between its stages is not what the uninterrupted run had there"
            )
    if len(ref) != len(res):
        return (
            f"between stages: the uninterrupted run made {len(ref)} calls (save, load, validate, lr_find, export, "
            f"stage ends), the resumed run {len(res)}"
        )
    return None


def _run(cmd, cwd, env, mode, trace, batches):
    e = dict(env, **{ENV: mode, ENV_TRACE: str(trace), ENV_BATCHES: str(batches), ENV_DIR: str(Path(trace).parent)})
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True)


def _started_from(ref: dict, res_between: list, key: tuple, stage: int) -> str:
    """Why the resumed stage's first batch started from another model or optimizer than the checkpoint's:
    the last between-stage load the resumed run made before that stage, or the script's own code."""
    loads = [ev for ev in res_between if ev[0] <= stage and ev[1] in ("load", "load_encoder")]
    where = f"the resumed stage {stage} did not start from the checkpoint's model and optimizer"
    if not loads:
        return (
            f"{where} (stage {key[0]}, fit {key[1]}, epoch {key[2]}, batch {key[3]}): something between the "
            "checkpoint's load and that fit changed them, and the fit trained on from there"
        )
    at, op, file, _ = loads[-1]
    return (
        f"between stages ({_where(at, op)}): {op}{' of ' + file if file else ''}, made again by the resumed run "
        f"before stage {stage}, left its weights in the learner: {where}, it trained on from that {op}'s"
    )


def _compare(ref, ref_between, res_t, p, kill_at) -> str | None:
    "What the resumed run (its trace `res_t`, its process `p`) does differently from the uninterrupted one."
    s, e, i = kill_at
    res, res_between, disarms, loader = _trace(res_t)
    if disarms:
        return (
            f"the resume was cancelled: {disarms[0]}. A load between stages that the uninterrupted run did not "
            "make at that point of the script loads other weights; the rerun then trains from them."
        )
    if p.returncode != 0:
        return f"the resumed run failed (exit {p.returncode}): {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
    first = min(res) if res else None
    for key in sorted(ref):
        if tuple(key[:1] + key[2:]) < (s, e, i):
            continue
        r = res.get(key)
        if r is None:
            return (
                f"stage {key[0]}, fit {key[1]}, epoch {key[2]}, batch {key[3]}: trained by "
                "the uninterrupted run, not by the resumed one"
            )
        for field in ("rng", "data", "in", "loss", "model", "opt"):
            if r.get(field) != ref[key].get(field):
                if field == "in" and key == first:
                    return _started_from(ref, res_between, key, s)
                stream = loader or {}
                if field == "data" and stream.get("stream"):
                    return (
                        f"first difference at stage {key[0]}, fit {key[1]}, epoch {key[2]}, batch {key[3]}: data. "
                        f"Cause: {_stream_cause(stream, key[2] > e and first is not None and first[2] == e)}."
                    )
                return (
                    f"first difference at stage {key[0]}, fit {key[1]}, epoch {key[2]}, "
                    f"batch {key[3]}: {field}. Likely cause: {_CAUSES[field]}."
                )
    bad = _first_between_difference(ref_between, res_between)
    if bad:
        return bad
    extra = sorted(set(res) - set(ref))
    if extra:
        return f"the resumed run trained batches the uninterrupted one did not: {extra[:3]}"
    return None


def _refused(p) -> str | None:
    "The line of a `ReplayError` that ended the resumed run `p` (a loud refusal, not a difference)."
    lines = [ln for ln in (p.stderr or "").splitlines() if ln.startswith("fastai_resume.between.ReplayError")]
    return lines[-1].split(": ", 1)[-1] if p.returncode != 0 and lines else None


def _remove(path) -> None:
    "The check's own checkpoint (a file or a sharded folder) and its data logs."
    try:
        stored.remove(path)
    except OSError:
        pass


def check(script: str, args=(), kill_at=None, batches: int = 8, cwd=None, python=sys.executable) -> CheckResult:
    """Run `script` (with `args`) uninterrupted, killed at `kill_at` = (stage, epoch, iteration) and
    resumed (both with and without the earlier stages' end states), and compare them batch by batch.
    By default it kills at the middle of the second epoch of the last stage that has two (or the first
    epoch of the last stage)."""
    cwd = str(cwd or os.getcwd())
    cmd = [python, str(script), *args]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="fastai-resume-check-") as tmp:
        ref_t, dead_t = Path(tmp) / "ref.jsonl", Path(tmp) / "dead.jsonl"
        p = _run(cmd, cwd, env, "record", ref_t, batches)
        if p.returncode != 0:
            return CheckResult(
                False,
                f"the script failed on its own (exit {p.returncode}): "
                f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}",
                None,
            )
        ref, ref_between, _, _ = _trace(ref_t)
        if not ref:
            return CheckResult(False, "the script trained no batch under fastai (no fit was seen)", None)
        if kill_at is None:
            stages = sorted({k[0] for k in ref})
            late = [s for s in stages if any(k[0] == s and k[2] >= 1 for k in ref)]
            s = late[-1] if late else stages[-1]
            e = 1 if late else 0
            its = sorted(k[3] for k in ref if k[0] == s and k[2] == e)
            kill_at = (s, e, max(1, (its[-1] + 1) // 2))
        s, e, i = kill_at
        try:
            p = _run(cmd, cwd, env, f"kill:{s},{e},{i}", dead_t, batches)
            if p.returncode != -signal.SIGKILL:
                return CheckResult(
                    False,
                    f"the run to be killed at stage {s}, epoch {e}, batch {i} was not killed there "
                    f"(exit {p.returncode}): is there such a batch?",
                    kill_at,
                )
            res_t = Path(tmp) / "res.jsonl"
            bad = _compare(ref, ref_between, res_t, _run(cmd, cwd, env, "resume", res_t, batches), kill_at)
            if bad:
                return CheckResult(False, bad, kill_at)
            n = sum(1 for k in ref if tuple(k[:1] + k[2:]) >= (s, e, i))
            msg = (
                f"exact: killed at stage {s}, epoch {e}, batch {i} and resumed, the {n} batches "
                "after it match the uninterrupted run (RNG, data, loss, model, optimizer)"
            )
            if s == 0:
                return CheckResult(True, msg, kill_at)
            # Resumed as after stages that saved nothing resumable: the stages before are passed without
            # their end states, and what the script does between them is replayed on the checkpoint's state.
            bare_t = Path(tmp) / "bare.jsonl"
            p = _run(cmd, cwd, env, "resume-bare", bare_t, batches)
            why = _refused(p)
            if why is not None:
                return CheckResult(
                    True,
                    f"{msg}; with no resumable save in the stages before it, a rerun refuses, before it writes "
                    f"anything: {why}",
                    kill_at,
                )
            bad = _compare(ref, ref_between, bare_t, p, kill_at)
            if bad:
                return CheckResult(
                    False, f"{bad} (resumed with no resumable save in the stages before stage {s})", kill_at
                )
            return CheckResult(True, f"{msg}, also with no resumable save in the stages before it", kill_at)
        finally:
            for line in dead_t.read_text().splitlines() if dead_t.exists() else ():
                if '"ckpt"' in line:
                    _remove(json.loads(line)["ckpt"])


FIT_HOOKS.append(probe_for)
BETWEEN_HOOKS.append(note_between)
