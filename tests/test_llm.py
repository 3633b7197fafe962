"""Fine-tuning an LLM as fastai's Hugging Face tutorial does it (tests/apps.py `llm`: a `transformers`
causal LM loaded with `from_pretrained` from a folder the script wrote, LoRA from `peft`,
`GradientAccumulation`, `lr_find`, `fit_one_cycle`, the adapter saved with `save_pretrained`), killed by
SIGKILL between two optimizer steps of an accumulation and run again unchanged: bitwise the uninterrupted
run down to the adapter file, by hand and with AutoCheckpoint, while each checkpoint holds what training
changes and the frozen base by fingerprint. A rerun on another base is refused (without the check it goes
on, silently other: the negative control); a frozen tensor changed in place mid-fit is held and exact.
fastai's own transfer learning (a frozen body with BatchNorm) is in tests/test_apps.py."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
from procs import equal
from test_apps import app_reference, assert_same, run_app, values

import fastai_resume as fr
from fastai_resume import unwritten

# fit_one_cycle(2): ~26 batches an epoch, an optimizer step every 3 (n_acc=24, bs 8): after batch 7 of
# epoch 0 the gradient of one batch is pending
MID_ACCUMULATION = "0,0,7"


def crash_file(folder, resume):
    "The resumable checkpoint the killed run left."
    if resume == "manual":
        return folder / "models" / "crash.frk"
    (path,) = sorted((folder / "models").glob("auto-*-i*.frk"))[-1:]
    return path


@pytest.mark.parametrize("resume", ["manual", "auto"])
def test_hf_tutorial_lora_killed_mid_accumulation_is_exact_down_to_the_adapter_file(tmp_root, tmp_path, resume):
    ref, ref_values = app_reference(tmp_root, "llm")
    run_app(
        "llm", tmp_path, tmp_path / "dead.frk", "--die", MID_ACCUMULATION, "--resume", resume, expect=-signal.SIGKILL
    )
    ckpt = fr.info(crash_file(tmp_path, resume))["tree"]
    assert ckpt["train"]["grads"] is not None  # killed with an accumulation in progress
    held, refs = ckpt["model"], ckpt["frozen"]
    assert all("lora_" in k for k in held) and len(held) == 4  # A and B of c_attn in 2 layers: what trains
    assert (
        "base_model.model.transformer.wte.weight" in refs and len(refs) == 29
    )  # the rest, the tied lm_head under its own name too
    log = run_app("llm", tmp_path, tmp_path / "out.frk", "--resume", resume)
    assert "resuming" in log
    assert values(log) == ref_values
    res = fr.load(tmp_path / "out.frk")
    assert_same(ref, res, ("model",))
    assert "adapter/adapter_model.safetensors" in ref["files"]  # (compared bitwise by assert_same)


def test_hf_tutorial_lora_saved_at_every_step_in_the_background_killed_mid_step_is_exact(tmp_root, tmp_path):
    """`AutoCheckpoint(every_iters=1)` with its background saves (each written at its batch's end, published
    by a thread while the next batch trains), SIGKILL in the middle of a step, no save of its own: the newest
    checkpoint is that of the batch before (or, its publish in flight, the one before it), and the rerun, which
    saves at every step too, is bitwise the uninterrupted run."""
    import re

    ref, ref_values = app_reference(tmp_root, "llm")
    every = ("--resume", "auto", "--every", "1")
    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die-mid", "0,0,7", *every, expect=-signal.SIGKILL)
    names = sorted(p.name for p in (tmp_path / "models").glob("auto-*-i*.frk"))
    # keep=2: retention at every step, by the thread that publishes, after its publish: killed between the two,
    # one more is left (the rerun's retention removes it)
    assert len(names) in (2, 3), names
    assert int(re.search(r"-i(\d+)\.frk$", names[-1])[1]) in (6, 7)  # killed in the step of batch 8 (i 7)
    log = run_app("llm", tmp_path, tmp_path / "out.frk", *every)
    assert "resuming" in log
    assert values(log) == ref_values
    assert_same(ref, fr.load(tmp_path / "out.frk"), ("model",))


def test_killed_while_its_thread_publishes_a_checkpoint_the_rerun_puts_it_in_place_and_loses_no_step(
    tmp_root, tmp_path
):
    """Every step saved in the background: a checkpoint is written whole at its batch's end, a thread syncs it
    and puts it in place. SIGKILL between the two (from that thread): its file is whole under its temporary
    name; the rerun verifies it, puts it in place, says so, resumes from that very step and is bitwise the
    uninterrupted run. A SIGKILL loses at most the step in flight."""
    import re

    ref, ref_values = app_reference(tmp_root, "llm")
    every = ("--resume", "auto", "--every", "1")
    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die-publishing", "7", *every, expect=-signal.SIGKILL)
    models = tmp_path / "models"
    names = sorted(p.name for p in models.glob("auto-*-i*.frk"))
    assert int(re.search(r"-i(\d+)\.frk$", names[-1])[1]) == 6  # the save of iteration 7 was not in place
    (temp,) = [p.name for p in models.iterdir() if p.name.startswith(".") and "-i0000000007.frk.tmp." in p.name]
    log = run_app("llm", tmp_path, tmp_path / "out.frk", *every)
    final = temp[1:].split(".tmp.")[0]
    assert f"AutoCheckpoint: {final} was written whole by a process killed before putting it in place" in log
    assert re.search(rf"resuming .*{re.escape(final)}", log), log
    assert values(log) == ref_values
    assert_same(ref, fr.load(tmp_path / "out.frk"), ("model",))


def test_a_rerun_on_another_base_model_is_refused_naming_the_tensor(tmp_root, tmp_path):
    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die", MID_ACCUMULATION, expect=-signal.SIGKILL)
    log = run_app("llm", tmp_path, tmp_path / "out.frk", "--base-seed", "1", expect=1)
    assert "the frozen tensor base_model.model.transformer.wte.weight is not the one this checkpoint" in log
    assert "another base model" in log
    assert not (tmp_path / "out.frk").exists() and not (tmp_path / "adapter").exists()


def test_negative_control_without_the_base_check_the_rerun_on_another_base_goes_on_and_differs(tmp_root, tmp_path):
    ref, _ = app_reference(tmp_root, "llm")
    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die", MID_ACCUMULATION, expect=-signal.SIGKILL)
    log = run_app("llm", tmp_path, tmp_path / "out.frk", "--base-seed", "1", "--no-base-check")
    assert "resuming" in log
    res = fr.load(tmp_path / "out.frk")
    assert not equal(ref["model"]["model"], res["model"]["model"])


@pytest.mark.parametrize("base", ["mapped", "copy"])
def test_a_frozen_tensor_changed_in_place_mid_fit_is_held_and_the_rerun_is_exact(tmp_root, tmp_path, base):
    """A callback writes into the frozen base mid-fit: the checkpoint holds what it wrote, whether the base is
    the file's pages (the page check sees it) or a copy in the process's memory (the kernel's write protection
    sees it: `unwritten`), and the rerun is exact."""
    touch = ("--touch-frozen",) + (("--copy-base",) if base == "copy" else ())
    every = {"FASTAI_RESUME_WRITE_TRACKING": "1"}  # (this base's weights are a few KiB: each tracked all the same)

    def make(d):
        log = run_app("llm", d, os.path.join(d, "out.frk"), "--resume", "none", "--touch-frozen")
        with open(os.path.join(d, "values.txt"), "w") as f:
            f.write("\n".join(values(log)))

    from procs import shared_run

    (ref,) = shared_run(tmp_root, "app-llm-touched", make)
    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die", "0,0,8", *touch, expect=-signal.SIGKILL, env=every)
    ckpt = fr.info(tmp_path / "models" / "crash.frk")["tree"]
    for name in ("transformer.wte.weight", "lm_head.weight"):  # changed since the base (tied): held in full
        assert "base_model.model." + name in ckpt["model"] and "base_model.model." + name not in ckpt["frozen"]
    assert len(ckpt["frozen"]) == 27
    log = run_app("llm", tmp_path, tmp_path / "out.frk", *touch, env=every)
    if base == "copy" and unwritten.available():  # its saves' fingerprints the kernel's word: proven, not read
        assert int(re.search(r"TRACKED \{'reads': \d+, 'proven': (\d+)\}", log)[1]) > 0, log[-2000:]
    assert_same(ref, fr.load(tmp_path / "out.frk"), ("model",))


def test_a_base_file_rewritten_in_place_after_its_crcs_were_remembered_is_refused(tmp_root, tmp_path):
    from apps import pretrained
    from test_provenance import new_process

    from fastai_resume import provenance

    run_app("llm", tmp_path, tmp_path / "dead.frk", "--die", MID_ACCUMULATION, expect=-signal.SIGKILL)
    base = tmp_path / "pretrained" / "model.safetensors"
    time.sleep(provenance._SETTLED_NS / 1e9 + 0.5)
    new_process(tmp_path / "pretrained")  # a process on this machine read it: its CRCs are remembered
    st = os.stat(base)
    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if not provenance._shared(version):
        pytest.skip("the test's folder is not on a local file system: nothing is remembered across processes")
    assert (Path(os.environ[provenance.ENV]) / provenance._file_name(version)).exists()
    assert new_process(tmp_path / "pretrained")[0] == 0  # and a new process checks it without reading it
    pretrained(str(tmp_path / "other"), 1)
    data = (tmp_path / "other" / "model.safetensors").read_bytes()
    assert len(data) == st.st_size
    with open(base, "r+b") as f:  # the same file, the same size, other weights: what a resumed run loads
        f.write(data)
    log = run_app("llm", tmp_path, tmp_path / "out.frk", expect=1)
    assert "is not the one this checkpoint was saved with" in log
    assert not (tmp_path / "out.frk").exists()


# ---- sharded: FSDP2 LoRA (tests/fsdp_lora.py, 2 ranks launched by torchrun, gloo) --------------------


def _fsdp_lora(path, out, *args, n=2, ok=True):
    import subprocess
    import sys

    from procs import ENV, HERE

    script = [os.path.join(HERE, "fsdp_lora.py"), "--path", str(path), "--out", str(out), *args]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    cmd = [sys.executable, *script] if "--plain" in args else launch + script
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


@pytest.mark.slow
def test_fsdp2_lora_checkpoints_hold_the_adapters_resume_bitwise_and_refuse_another_base_at_any_world_size(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    _fsdp_lora(ref, ref / "out.frk")
    p = _fsdp_lora(run, run / "dead.frk", "--die-at", "7", ok=False)
    assert p.returncode != 0 and "SIGKILL" in p.stdout + p.stderr
    folder = run / "models" / "crash.frk"
    base = fr.load(ref / "out.frk.rank0")["params"]
    frozen = {k for k in base if "lora_" not in k}
    for f in sorted(folder.glob("shard-*")):  # each rank: its part of the adapters, the base by fingerprint
        tree = fr.load(f)
        assert set(tree["model"]) <= {k for k in base if "lora_" in k} and len(tree["model"]) == len(base) - len(frozen)
        assert set(tree["frozen"]) >= frozen  # (and the tied head under its own name)
    _fsdp_lora(run, run / "res.frk", "--resume", "crash")
    for r in range(2):  # bitwise the uninterrupted run on every rank: losses and every parameter
        a, b = fr.load(ref / f"out.frk.rank{r}"), fr.load(run / f"res.frk.rank{r}")
        assert equal(a["losses"], b["losses"]) and equal(a["params"], b["params"]), f"rank {r}"
    p = _fsdp_lora(run, run / "bad.frk", "--resume", "crash", "--base-seed", "1", ok=False)
    out = p.stdout + p.stderr
    for r in (0, 1):  # another base: refused on every rank, naming a tensor, before anything trains
        assert f"[rank{r}]: fastai_resume.CheckpointError: {folder}: the frozen tensor" in out, out[-4000:]
    assert not (run / "bad.frk.rank0").exists()
    # 2 ranks -> 1 process, the model not sharded: the same fingerprints check the same base
    p = _fsdp_lora(run, run / "one.frk", "--plain", "--resume", "crash")
    assert "resuming" in p.stdout and "saved by 2 process(es) and this fit runs 1" in p.stdout + p.stderr
    p = _fsdp_lora(run, run / "onebad.frk", "--plain", "--resume", "crash", "--base-seed", "1", ok=False)
    assert p.returncode != 0 and "is not the one this checkpoint was saved with" in p.stderr, p.stderr[-3000:]
