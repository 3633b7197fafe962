"""The training state as a table of pieces (`fastai_resume.pieces`): a checkpoint's `train` and a stage's end
state are their tables walked, key for key as the files hold them; a piece added to a table is captured,
checked and restored with no other change; and the validation kit (`fields`) names the field it refuses,
for the training state, a sharded checkpoint's manifest and a remote marker alike."""

import json

import pytest
from fastai.callback.core import Callback
from test_resume_rules import StopAt, fit
from trainer import build

import fastai_resume as fr
from fastai_resume import fields, objstore, pieces, trainstate

# the layouts on disk (schema 4), spelled out: a file written now holds exactly these keys, in this order
CHECKPOINT_KEYS = [
    "position", "stages", "rng_stage", "rng", "rng_valid", "rng_epoch", "loaders_now", "loaders_epoch", "recorder",
    "modules", "ranks", "hypers", "grads", "grad_set", "trainable", "rows", "callbacks", "script",
]  # fmt: skip
END_KEYS = [
    "stage", "token", "signature", "rng", "loaders", "modules", "recorder", "ranks", "callbacks", "grad_set",
    "trainable", "training", "learner", "rows",
]  # fmt: skip


def layout(table) -> list:
    "A table's keys in order, `ranks` (every other rank's per-rank pieces) right after its last per-rank piece."
    keys: list = []
    last = max(i for i, p in enumerate(table) if p.per_rank)
    for i, p in enumerate(table):
        keys += list(p.keys) + (["ranks"] if i == last else [])
    return keys


class SaveMid(Callback):
    "Saves a resumable checkpoint after training batch 5 of the first epoch; the fit goes on."

    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter + 1 == 5:
            self.learn.save("mid", with_iter=True)


def test_a_checkpoint_holds_the_keys_of_its_table_in_the_tables_order(tmp_path):
    fit(build(tmp_path, noise=False), 2, 1e-2, cbs=StopAt(1, 10))
    train = fr.load(tmp_path / "models" / "ck.frk")["train"]
    assert list(train) == CHECKPOINT_KEYS == layout(pieces.CHECKPOINT)


def test_a_stage_end_holds_the_keys_of_its_table_in_the_tables_order(tmp_path):
    fit(build(tmp_path, noise=False), 1, 1e-2, cbs=SaveMid())
    (end_file,) = (tmp_path / "models").glob("*-end.frk")
    assert list(fr.load(end_file)["end"]) == END_KEYS == layout(pieces.STAGE_END)


# ---- a piece added to the table: one entry, nothing else changed --------------------------------------------


class Tally(Callback):
    "Counts the training batches on the learner (`learn.seen`): state that no piece of the library saves."

    def before_fit(self):
        if not hasattr(self.learn, "seen"):
            self.learn.seen = 0

    def after_batch(self):
        if self.training:
            self.learn.seen += 1


SEEN = pieces.Piece(
    ("seen",),
    capture=lambda now: {"seen": now.learn.seen},
    check=lambda t, where: fields.an_int(t["seen"], f"{where}.seen"),
    at_fit=lambda learn, sv: setattr(learn, "seen", sv["seen"]),
)


def _resumed_tally(path) -> tuple:
    "(batches the uninterrupted fit counted, what the fit killed at epoch 1, batch 10 and resumed counts)."
    whole = fit(build(path / "whole", noise=False), 2, 1e-2, cbs=Tally())
    fit(build(path / "cut", noise=False), 2, 1e-2, cbs=[Tally(), StopAt(1, 10)])
    fresh = build(path / "cut", noise=False)
    fresh.load("ck")
    return whole.seen, fit(fresh, 2, 1e-2, cbs=Tally()).seen


def test_a_piece_added_to_the_table_is_captured_and_restored(tmp_path, monkeypatch):
    monkeypatch.setattr(trainstate, "CHECKPOINT", pieces.CHECKPOINT + (SEEN,))
    whole, resumed = _resumed_tally(tmp_path)
    assert resumed == whole == 2 * 46
    assert fr.load(tmp_path / "cut" / "models" / "ck.frk")["train"]["seen"] == 46 + 10


def test_without_the_piece_the_resumed_count_differs(tmp_path):
    "The control: the same state, no piece for it, and the resumed fit counts only the batches it trained."
    whole, resumed = _resumed_tally(tmp_path)
    assert (whole, resumed) == (2 * 46, 46 - 10)


def test_a_piece_added_to_the_table_is_checked_at_load_naming_its_field(tmp_path, monkeypatch):
    monkeypatch.setattr(trainstate, "CHECKPOINT", pieces.CHECKPOINT + (SEEN,))
    fit(build(tmp_path, noise=False), 2, 1e-2, cbs=[Tally(), StopAt(1, 10)])
    tree = fr.load(tmp_path / "models" / "ck.frk")
    tree["train"]["seen"] = "56"
    fr.save(tree, tmp_path / "models" / "bad.frk")
    with pytest.raises(fr.CheckpointError, match=r"malformed training state: train\.seen: expected an int >= 0"):
        build(tmp_path, noise=False).load("bad")
    del tree["train"]["seen"]
    fr.save(tree, tmp_path / "models" / "bad.frk")
    with pytest.raises(fr.CheckpointError, match="malformed training state: train: missing 'seen'"):
        build(tmp_path, noise=False).load("bad")


# ---- the validation kit ----------------------------------------------------------------------------------


def test_a_field_error_names_the_path_and_what_is_wrong():
    with pytest.raises(fr.CheckpointError) as e:
        with fields.refused("f.frk: malformed training state: "):
            fields.an_int(True, "train.position.epoch")  # a bool is no count
    assert str(e.value) == "f.frk: malformed training state: train.position.epoch: expected an int >= 0, got True"
    with pytest.raises(fr.CheckpointError, match=r"^x: train: missing 'rng'$"):
        with fields.refused("x: "):
            fields.a_dict({}, "train", ("rng",))


def test_a_malformed_remote_marker_is_refused_naming_the_field():
    def marker(**kw):
        return json.dumps({"name": "a.frk", "size": 3, "crc32c": 7, "ends": [], **kw}).encode()

    assert objstore.parse_marker(marker(), "a.frk", "u")["size"] == 3
    with pytest.raises(fr.CheckpointError, match=r"^u: malformed marker: marker\.crc32c: expected an int in \[0, "):
        objstore.parse_marker(marker(crc32c=1 << 40), "a.frk", "u")
    with pytest.raises(fr.CheckpointError, match=r"^u: malformed marker: marker\.ends\[0\]\.size: expected an int"):
        objstore.parse_marker(marker(ends=[{"size": True, "crc32c": 1, "file": "e", "key": "k"}]), "a.frk", "u")
    with pytest.raises(fr.CheckpointError, match=r"^u: malformed marker: marker: expected an object"):
        objstore.parse_marker(b"[1]", "a.frk", "u")
    with pytest.raises(fr.CheckpointError, match=r"^u: malformed marker: Expecting value"):  # (the JSON parser's words)
        objstore.parse_marker(b"", "a.frk", "u")
