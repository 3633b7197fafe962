"""What a checkpoint holds of a model fastai froze (`Learner.freeze`, `train_bn`): what training changes,
the rest by fingerprint, checked against the learner on every load and at a resumed fit's start.
In-process, on the suite's digits learner with a BatchNorm layer in its frozen body; the whole scripts
(the Hugging Face recipe with LoRA, vision_learner's fine_tune) are in test_llm.py and test_apps.py."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from fastai.callback.core import Callback
from procs import equal
from trainer import build

import fastai_resume as fr
from fastai_resume import _core

FROZEN = {"0.weight", "0.bias"}  # the body's Linear; its BatchNorm trains (fastai's train_bn)


def frozen_learner(tmp_path, cbs=()):
    "The digits learner with a body (Linear, BatchNorm) and a head, split and frozen as fastai freezes."
    learn = build(tmp_path, bn=True, extra_cbs=cbs)
    learn.splitter = lambda m: [list(m[:2].parameters()), list(m[2:].parameters())]
    learn.create_opt()
    learn.freeze()
    return learn


def trained(tmp_path, cbs=()):
    learn = frozen_learner(tmp_path, cbs)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-2)
    return learn


class SaveAt(Callback):
    "Saves a resumable checkpoint after training batch `k` of the first epoch."

    def __init__(self, k=5):
        self.k = k

    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter + 1 == self.k:
            self.learn.save("mid", with_iter=True)


def test_a_checkpoint_holds_what_trains_and_the_frozen_rest_by_fingerprint(tmp_path):
    learn = trained(tmp_path)
    tree = fr.load(learn.save("m", with_iter=True))
    assert set(tree["frozen"]) == FROZEN
    assert set(tree["model"]) == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"} | {
        "4.weight",
        "4.bias",
    }
    w = learn.model[0].weight
    assert tree["frozen"]["0.weight"] == {
        "crc": _core.crc32c(w.detach().numpy()),
        "shape": [37, 64],
        "dtype": "float32",
    }
    assert (
        fr.info(learn.path / "models" / "m.frk")["size"]
        < 0.5 * fr.info(learn.save("f", with_iter=True, full=True))["size"]
    )


def test_a_frozen_tensor_changed_in_place_is_held_not_referenced(tmp_path):
    learn = trained(tmp_path)
    learn.model[0].bias.data[0] += 1  # no autograd, no version counter: only its bytes tell
    tree = fr.load(learn.save("m", with_iter=True))
    assert "0.bias" in tree["model"] and set(tree["frozen"]) == {"0.weight"}
    assert torch.equal(tree["model"]["0.bias"], learn.model[0].bias)


def test_loading_a_delta_file_restores_the_model_bitwise(tmp_path):
    learn = trained(tmp_path)
    learn.save("m", with_iter=True)
    fresh = frozen_learner(tmp_path)
    fresh.load("m")
    assert equal(fresh.model.state_dict(), learn.model.state_dict())
    assert equal(fr.state.plain(fresh.opt.state_dict()), fr.state.plain(learn.opt.state_dict()))


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: m[0].weight.data.add_(1e-6), "the frozen tensor 0.weight is not the one this checkpoint"),
        (lambda m: m[0].bias.data.zero_(), "the frozen tensor 0.bias is not the one this checkpoint"),
    ],
    ids=["other-base-weight", "other-base-bias"],
)
def test_a_load_on_another_base_is_refused_before_anything_changes(tmp_path, change, says):
    learn = trained(tmp_path)
    path = learn.save("m", with_iter=True)
    fresh = frozen_learner(tmp_path)
    change(fresh.model)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(fr.CheckpointError, match=says) as e:
        fresh.load("m")
    assert str(path) in str(e.value) and "another base model" in str(e.value)
    assert equal(fresh.model.state_dict(), before)
    assert fr.script.script(fresh).armed is None


def test_a_model_missing_a_referenced_tensor_or_with_another_shape_is_refused(tmp_path):
    learn = trained(tmp_path)
    learn.save("m", with_iter=True)
    other = frozen_learner(tmp_path)
    other.model[0] = torch.nn.Linear(64, 37, bias=False)
    with pytest.raises(fr.CheckpointError, match=r"unexpected keys \['0.bias'\]"):
        other.load("m")
    other.model[0] = torch.nn.Linear(63, 37)
    with pytest.raises(fr.CheckpointError, match=r"0.weight: shape \(37, 64\) in the file, \(37, 63\) in the model"):
        other.load("m")


def test_a_resumed_fit_with_another_frozen_set_is_refused_and_the_same_set_resumes(tmp_path):
    trained(tmp_path, cbs=[SaveAt()])
    fresh = frozen_learner(tmp_path)
    fresh.load("mid")
    for p in fresh.model.parameters():  # as many frozen (the stage's signature counts them), but others
        p.requires_grad_(not (p is fresh.model[4].weight or p is fresh.model[4].bias))
    with pytest.raises(
        fr.CheckpointError, match="0.weight was frozen when the checkpoint was saved and is trainable here"
    ):
        with fresh.no_bar(), fresh.no_logging():
            fresh.fit(1, 1e-2)
    same = frozen_learner(tmp_path)
    same.load("mid")
    with same.no_bar(), same.no_logging():
        same.fit(1, 1e-2)
    assert equal(same.model.state_dict(), trained(tmp_path / "ref").model.state_dict())


@pytest.mark.parametrize(
    "write",
    [
        lambda w: torch.no_grad()(w.copy_)(torch.zeros(37, 64)),  # as a load_state_dict would
        lambda w: w.data.add_(1),  # no autograd, no version counter: only its bytes tell
    ],
    ids=["copy", "data"],
)
def test_a_referenced_tensor_changed_after_the_load_is_refused_as_the_resumed_fit_starts(tmp_path, write):
    trained(tmp_path, cbs=[SaveAt()])
    fresh = frozen_learner(tmp_path)
    fresh.load("mid")
    write(fresh.model[0].weight)
    with pytest.raises(fr.CheckpointError, match=r"0.weight is not the one .*\(checked as the resumed fit starts\)"):
        with fresh.no_bar(), fresh.no_logging():
            fresh.fit(1, 1e-2)


def test_a_load_that_arms_a_resume_changes_nothing_until_the_fit_and_another_base_is_refused_there(tmp_path):
    ref = trained(tmp_path, cbs=[SaveAt()])
    other = frozen_learner(tmp_path)
    other.model[0].bias.data.add_(1)  # another base
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    other.load("mid")  # said, not refused: the script may load the base before the fit
    assert equal(other.model.state_dict(), before) and fr.script.script(other).armed is not None
    with pytest.raises(fr.CheckpointError, match="the frozen tensor 0.bias is not the one"):
        with other.no_bar(), other.no_logging():
            other.fit(1, 1e-2)
    assert equal(other.model.state_dict(), before)  # refused before anything was put in or trained
    same = frozen_learner(tmp_path)
    same.load("mid")
    with same.no_bar(), same.no_logging():
        same.fit(1, 1e-2)
    assert equal(same.model.state_dict(), ref.model.state_dict())


def test_a_model_with_a_lazy_layer_fits_and_saves(tmp_path):
    learn = build(tmp_path)
    learn.model[0] = torch.nn.LazyLinear(128)
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-3, cbs=[SaveAt()])
    assert "0.weight" in fr.load(tmp_path / "models" / "mid.frk")["model"]


def test_full_true_and_make_full_give_a_self_contained_file(tmp_path):
    learn = trained(tmp_path)
    delta = learn.save("m", with_iter=True)
    full = fr.load(learn.save("f", with_iter=True, full=True))
    assert "frozen" not in full and set(full["model"]) == set(learn.model.state_dict())
    made = fr.load(fr.make_full(learn, delta, tmp_path / "made.frk"))
    assert "frozen" not in made and list(made["model"]) == list(learn.model.state_dict())
    assert equal(made["model"], full["model"]) and equal(made["opt"], full["opt"])
    other = frozen_learner(tmp_path)
    other.model[0].weight.data.add_(1)
    with pytest.raises(fr.CheckpointError, match="0.weight is not the one"):
        fr.make_full(other, delta, tmp_path / "bad.frk")
    assert not (tmp_path / "bad.frk").exists()


def hostile(tree, **frozen_entry):
    tree = dict(tree)
    tree["frozen"] = {**tree["frozen"], "0.weight": {**tree["frozen"]["0.weight"], **frozen_entry}}
    return tree


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda t: hostile(t, crc=-1), r"frozen\['0.weight'\].crc: expected a 32-bit checksum"),
        (lambda t: hostile(t, crc=1 << 32), r"frozen\['0.weight'\].crc: expected a 32-bit checksum"),
        (lambda t: hostile(t, crc="0"), r"frozen\['0.weight'\].crc: expected a 32-bit checksum"),
        (lambda t: hostile(t, shape=[37, -64]), r"frozen\['0.weight'\].shape: expected a list of at most 32 sizes"),
        (lambda t: hostile(t, dtype="float99"), r"frozen\['0.weight'\].dtype: 'float99' is not a torch dtype"),
        (lambda t: hostile(t, shape=[1 << 62, 1 << 62]), r"frozen\['0.weight'\].shape: .* is more than 2\^63 bytes"),
        (lambda t: hostile(t, shape=[1] * 33), r"frozen\['0.weight'\].shape: expected a list of at most 32 sizes"),
        (lambda t: {**hostile(t), "frozen": {**t["frozen"], "0.weight": [1, 2]}}, r"expected a name and \{crc"),
        (lambda t: {**t, "frozen": [1]}, "'frozen' is a list, expected a dict"),
        (
            lambda t: {**t, "model": {**t["model"], "0.weight": torch.zeros(37, 64)}},
            r"frozen\['0.weight'\]: also held in 'model'",
        ),
    ],
    ids=[
        "crc-negative",
        "crc-too-big",
        "crc-str",
        "shape-negative",
        "dtype",
        "shape-huge",
        "shape-many-dims",
        "entry-list",
        "frozen-list",
        "held-too",
    ],
)
def test_a_malformed_frozen_field_is_refused_naming_it(tmp_path, edit, says):
    learn = trained(tmp_path)
    tree = fr.load(learn.save("m", with_iter=True))
    fr.save(edit(tree), tmp_path / "models" / "bad.frk")
    fresh = frozen_learner(tmp_path)
    with pytest.raises(fr.CheckpointError, match=says):
        fresh.load("bad")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_crc32c_many_is_crc32c_of_each_buffer(threads):
    g = np.random.default_rng(0)
    sizes = [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20, 5_000_003, 17]
    bufs = [g.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    assert _core.crc32c_many(bufs, threads) == [_core.crc32c(b) for b in bufs]
    assert _core.crc32c_many([], threads) == []
    with pytest.raises(TypeError):
        _core.crc32c_many([b"ok", 3], threads)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "fastai_resume", *map(str, args)], capture_output=True, text=True)


def test_inspect_lists_the_references_verify_checks_the_bytes_held_and_convert_refuses_a_delta(tmp_path):
    learn = trained(tmp_path)
    path = learn.save("m", with_iter=True)
    out = cli("inspect", path)
    assert out.returncode == 0, out.stderr
    crc = fr.load(path)["frozen"]["0.weight"]["crc"]
    assert "frozen, by fingerprint (not held): 2 tensors, 9,620 bytes" in out.stdout
    assert "0.weight" in out.stdout and f"crc32c {crc:08x}" in out.stdout
    assert cli("verify", path).returncode == 0
    bad = cli("convert", path, tmp_path / "m.pth")
    assert bad.returncode != 0 and "references 2 frozen tensors it does not hold" in bad.stderr
    assert "make_full" in bad.stderr and not (tmp_path / "m.pth").exists()


# ---- the fingerprint computed where a tensor lives (h64: torch operations on its device) ---------------


def _h64_by_hand(t) -> int:
    "The definition, in Python integers: word i (the element's bits, signed) times an odd constant drawn from i."
    from fastai_resume.frozen import _K1, _K2, _WORD

    words = t.contiguous().reshape(-1).view(_WORD[min(t.element_size(), 8)] if t.dtype != torch.bool else torch.int8)
    m, total = (1 << 64) - 1, 0
    for i, w in enumerate(words.tolist()):
        z = (i * _K1) & m
        z = z - (1 << 64) if z >> 63 else z  # (as a signed 64-bit integer: the shift is arithmetic)
        z = ((z ^ (z >> 31)) * _K2) & m
        total += int(w) * (z | 1)
    return total & m


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.complex128]
)
def test_h64_is_its_definition_adds_up_over_shards_and_sees_any_changed_word(dtype):
    from fastai_resume.frozen import h64

    g = torch.Generator().manual_seed(0)
    t = (torch.randn(7, 5, generator=g) * 10).to(dtype) if dtype != torch.complex128 else torch.randn(7, 5, dtype=dtype)
    if dtype == torch.bool:
        t = torch.rand(7, 5, generator=g) > 0.5
    m = (1 << 64) - 1
    assert h64(t) & m == _h64_by_hand(t)  # (the files' fingerprints: any change of the definition fails here)
    assert -(1 << 63) <= h64(t) < 1 << 63  # (stored as the format's signed 64-bit integer)
    words = 5 * max(1, t.element_size() // 8)  # a row's words
    for cut in (0, 3, 7):  # FSDP's rows per rank: the parts' sums, each from its first word, are the whole's
        assert (h64(t[:cut]) + h64(t[cut:], first_word=cut * words)) & m == h64(t) & m
    assert h64(t.t()) == h64(t.t().contiguous())  # (a view: its bytes in order)
    flipped = t.clone()
    flipped.view(-1).view(torch.uint8)[11] ^= 1  # one bit of one byte
    assert h64(flipped) != h64(t)


def test_a_checkpoint_fingerprinted_where_its_base_lives_loads_anywhere_and_refuses_another_base(tmp_path, monkeypatch):
    "FASTAI_RESUME_FINGERPRINT=h64 takes the device's way on the CPU (no GPU here): the same code as on a GPU."
    monkeypatch.setenv("FASTAI_RESUME_FINGERPRINT", "h64")
    learn = trained(tmp_path)
    tree = fr.load(learn.save("m", with_iter=True))
    assert set(tree["frozen"]) == FROZEN and all(set(f) == {"h64", "shape", "dtype"} for f in tree["frozen"].values())
    monkeypatch.delenv("FASTAI_RESUME_FINGERPRINT")  # a process whose base is on the CPU: CRC32Cs its own way
    fresh = frozen_learner(tmp_path)
    fresh.load("m")  # (its references' kind is computed)
    assert equal(fresh.model.state_dict(), learn.model.state_dict())
    other = frozen_learner(tmp_path)
    other.model[0].weight.data[0, 0] += 1
    with pytest.raises(fr.CheckpointError, match=r"0\.weight is not the one .*fingerprint \(h64\)"):
        other.load("m")
    assert set(fr.load(learn.save("again", with_iter=True))["frozen"]) == FROZEN  # (its stage's kind, whatever now)
    crc_file = trained(tmp_path).save("c", with_iter=True)  # and the other way: CRC32C references, an h64 process
    assert all(set(f) == {"crc", "shape", "dtype"} for f in fr.load(crc_file)["frozen"].values())
    monkeypatch.setenv("FASTAI_RESUME_FINGERPRINT", "h64")
    frozen_learner(tmp_path).load(crc_file)


def test_h64_fingerprints_of_either_sign_are_stored_and_validated(tmp_path):
    "Half of all sums mod 2^64 are 2^63 or more: stored as the format's signed integers, each one validated."
    from fastai_resume.frozen import fingerprints, validate

    g = torch.Generator().manual_seed(0)
    got = fingerprints({f"t{i}": torch.randn(5, generator=g) for i in range(16)}, {f"t{i}": "h64" for i in range(16)})
    assert {v["h64"] < 0 for v in got.values()} == {True, False}
    fr.save({"model": {}, "frozen": got}, tmp_path / "f.frk")
    tree = fr.load(tmp_path / "f.frk")
    validate(tree, "f.frk")
    assert tree["frozen"] == got
