"""Trust under attack and accident: a checkpoint with valid checksums but hostile or malformed content
never runs code, never half-loads a learner and never explodes later in `fit`; AutoCheckpoint never
touches another run's files, refuses a second process on its run, and never takes a transient error
for corruption."""

import errno
import os
import pickle
import random
import subprocess
import sys
import time

import pytest
import torch
from fastai.callback.tracker import SaveModelCallback
from procs import ENV, equal, tmpfs
from test_resume_rules import StopAt, fit
from trainer import build

import fastai_resume as fr


@pytest.fixture(scope="module")
def mid_fit_file(tmp_path_factory):
    "A real checkpoint saved mid-fit (epoch 1, batch 10), and the folder it is in; each test gets its own copy."
    d = tmp_path_factory.mktemp("trust")
    learn = build(d, noise=False, extra_cbs=[SaveModelCallback(monitor="valid_loss", fname="best")])
    fit(learn, 3, 1e-2, cbs=StopAt(1, 10))
    return d, fr.load(d / "models" / "ck.frk")


@pytest.fixture
def mid_fit(mid_fit_file):
    import copy

    d, tree = mid_fit_file
    return d, copy.deepcopy(tree)


def resealed(d, tree, name):
    "The tree written as a checkpoint with valid checksums: only its content is hostile."
    fr.save(tree, d / "models" / f"{name}.frk")
    return name


class Payload:
    "Unpickling it creates a marker file: proof that code ran."

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_callback_state_cannot_steer_fastai_into_unpickling_a_file(mid_fit, tmp_path):
    d, tree = mid_fit
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    with open(evil, "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    (evil.parent / "evil.pth").touch()
    for cb in tree["train"]["callbacks"].values():
        cb.update(fname=str(evil.with_suffix("")), with_opt=True, every_epoch=True, monitor="accuracy")
    name = resealed(d, tree, "steer")
    learn = build(d, noise=False, extra_cbs=[SaveModelCallback(monitor="valid_loss", fname="best")])
    learn.load(name)
    fit(learn, 3, 1e-2)
    assert not marker.exists()
    assert learn.save_model.fname == "best" and learn.save_model.monitor == "valid_loss"


def test_a_wrong_type_for_a_known_callback_field_is_refused(mid_fit):
    d, tree = mid_fit
    next(iter(tree["train"]["callbacks"].values()))["wait"] = "3"
    learn = build(d, noise=False, extra_cbs=[SaveModelCallback(monitor="valid_loss", fname="best")])
    learn.load(resealed(d, tree, "badwait"))
    with pytest.raises(fr.CheckpointError, match="wait: str in the file"):
        fit(learn, 3, 1e-2)


def _act_stats_learner(d):
    from fastai.callback.hook import ActivationStats

    return build(d, noise=False, extra_cbs=[ActivationStats(with_hist=True, every=3)])


def _act_stats(learn):
    return [[{k: v for k, v in m.items()} for m in b] for b in learn.activation_stats.stats]


@pytest.fixture(scope="module")
def act_stats_ck(tmp_path_factory):
    "An uninterrupted fit's ActivationStats batches, and the folder of the same fit saved at epoch 1, batch 10."
    d = tmp_path_factory.mktemp("act-stats")
    want = _act_stats(fit(_act_stats_learner(d), 2, 1e-2))
    fit(_act_stats_learner(d), 2, 1e-2, cbs=StopAt(1, 10))
    return d, want


def test_activation_stats_resumed_mid_fit_are_the_uninterrupted_runs(act_stats_ck):
    """fastai's ActivationStats keeps every recorded batch (floats and a histogram per layer; the checkpoint
    stacks the histograms into one tensor): resumed mid-fit, it ends with the uninterrupted run's, bitwise."""
    d, want = act_stats_ck
    st = fr.load(d / "models" / "ck.frk")["train"]["callbacks"]["activation_stats"]
    assert isinstance(st["hists"], torch.Tensor) and st["hists"].shape[0] > 10  # one tensor, not one per layer
    learn = _act_stats_learner(d)
    learn.load("ck")
    assert equal(want, _act_stats(fit(learn, 2, 1e-2)))


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda st: st.update(hists=st["hists"][:-1]), "histograms in its batches"),
        (lambda st: st.update(hists="x"), "hists: str"),
        (lambda st: st["stats"][0][0].update(mean="0.1"), "mean, std, near_zero"),
        (lambda st: st["stats"][0][0].update(hist=1), "mean, std, near_zero"),
        (lambda st: st["stats"][1].append({"path": "/etc/passwd"}), "mean, std, near_zero"),
        (lambda st: st.update(stats={"0": []}), "a list of batches"),
    ],
    ids=["one-histogram-short", "hists-not-a-tensor", "mean-a-str", "hist-marker-an-int", "unknown-key", "not-a-list"],
)
def test_activation_stats_of_another_shape_in_a_file_are_refused_as_the_fit_starts(act_stats_ck, spoil, why):
    d, _ = act_stats_ck
    tree = fr.load(d / "models" / "ck.frk")
    spoil(tree["train"]["callbacks"]["activation_stats"])
    learn = _act_stats_learner(d)
    learn.load(resealed(d, tree, "spoiled"))
    with pytest.raises(fr.CheckpointError, match=f"callback state ActivationStats.*{why}"):
        fit(learn, 2, 1e-2)


@pytest.mark.parametrize("bad", ["numpy", "dtype"])
def test_a_model_entry_of_the_wrong_type_leaves_model_and_optimizer_untouched(mid_fit, bad):
    d, tree = mid_fit
    keys = list(tree["model"])
    tree["model"][keys[-1]] = (
        tree["model"][keys[-1]].numpy() if bad == "numpy" else tree["model"][keys[-1]].to(torch.int32)
    )
    learn = build(d, noise=False)
    fit(learn, 1, 1e-2)
    model, opt = {k: v.clone() for k, v in learn.model.state_dict().items()}, fr.state.plain(learn.opt.state_dict())
    with pytest.raises(fr.CheckpointError, match="does not fit this learner's model"):
        learn.load(resealed(d, tree, "half"))
    assert equal(model, learn.model.state_dict()) and equal(opt, fr.state.plain(learn.opt.state_dict()))


@pytest.mark.parametrize(
    "where, value, field",
    [
        (("position", "epoch"), "1", "train.position.epoch"),
        (("position", "iter"), 10**6, "train.position"),
        (("hypers",), {"lr": 1}, "train.hypers"),
        (("position",), {}, "train.position"),
        (("rng", "torch"), [1, 2], "train.rng.torch"),
        (("recorder", "lrs"), torch.zeros(4), "train.recorder.lrs"),
        (("stages",), [], "train.stages"),
        (("grad_set",), [1, 0], "train.grad_set"),
        (("grad_set",), [True], "train.grad_set has 1 entries"),
        (("modules",), {"": {"attrs": {"h": "x"}}}, r"train.modules\[''\].attrs: 'h': expected tensors"),
        (("modules",), {"": {"attrs": {"h": [torch.zeros(2), 3]}}}, r"train.modules\[''\].attrs: 'h'"),
        (("modules",), {"": {"attrs": {"h": []}}}, r"train.modules\[''\].attrs: 'h'"),
    ],
)
def test_a_malformed_training_state_is_refused_at_load_naming_the_field(mid_fit, where, value, field):
    d, tree = mid_fit
    node = tree["train"]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    learn = build(d, noise=False)
    with pytest.raises(fr.CheckpointError, match=f"malformed training state: {field}"):
        learn.load(resealed(d, tree, "malformed"))
    assert fr.script.script(learn).armed is None


@pytest.mark.parametrize("attr", ["h", "_private", "training", "0"])
def test_a_hidden_state_naming_what_the_model_lacks_or_must_not_be_set_is_refused_as_the_fit_starts(mid_fit, attr):
    """A file's hidden-state attributes (`state.module_states`' `attrs`) are set on the model only where it has
    a public attribute of that name (torch keeps its own, a child module's included, apart): any other name is
    refused."""
    d, tree = mid_fit
    tree["train"]["modules"] = {"": {"attrs": {attr: torch.zeros(2)}}}
    learn = build(d, noise=False)
    learn.load(resealed(d, tree, "hostile"))
    with pytest.raises(fr.CheckpointError, match=rf"model state ''.{attr}: "):
        fit(learn, 3, 1e-2)


def _mutations(tree, rng, n):
    "n copies of the training state, each with one node replaced by a value of another kind, or removed."
    import copy

    paths = []

    def walk(v, p):
        paths.append(p)
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, p + (k,))
        elif isinstance(v, (list, tuple)) and len(v) < 50:
            for i, x in enumerate(v):
                walk(x, p + (i,))

    walk(tree["train"], ())
    others = [None, -1, 2**40, 1.5, "x", b"\0", [], {}, (), torch.zeros(3), torch.zeros(2, dtype=torch.uint8)]
    for _ in range(n):
        t = copy.deepcopy(tree)
        p = rng.choice(paths[1:])
        node = t["train"]
        for k in p[:-1]:
            node = node[k]
        if isinstance(node, tuple):
            continue
        if rng.random() < 0.2 and isinstance(node, dict):
            del node[p[-1]]
        else:
            node[p[-1]] = rng.choice(others)
        yield p, t


def _fuzz(d, tree, n=120, trained=8):
    """Each of `n` mutations is refused by `load` with a CheckpointError, or trains (the first `trained`
    that load accepts are trained); an AssertionError names the first that passed load and then failed."""
    rng = random.Random(0)
    accepted, fits = 0, 0
    for p, t in _mutations(tree, rng, n):
        learn = build(d, noise=False)
        try:
            learn.load(resealed(d, t, "fuzz"))
        except fr.CheckpointError:
            continue
        accepted += 1
        if fits < trained:  # what load accepted must train (a mutation it could not see matters to nothing)
            fits += 1
            try:
                fit(learn, 3, 1e-2)
            except fr.CheckpointError as e:
                if p[0] != "callbacks" or "callback state" not in str(e):
                    raise AssertionError(f"mutation at {p} passed load, then fit failed: {e!r}") from e
            except ValueError as e:  # a saved stage this script's differs from: the refusal users get
                if "resuming would not give the uninterrupted run's result" not in str(e):
                    raise AssertionError(f"mutation at {p} passed load, then fit failed: {e!r}") from e
            except Exception as e:
                raise AssertionError(f"mutation at {p} passed load, then fit failed: {e!r}") from e
    return accepted, fits


def test_structure_aware_fuzz_of_the_training_state_never_fails_later_than_load(mid_fit):
    """The one state `load` cannot check is the callbacks' (those given to `fit(cbs=...)` do not exist
    yet): a mutation there may be refused as the fit starts, before anything is trained, naming the
    callback. Enough mutations are accepted and trained that a `load` refusing everything fails here."""
    accepted, fits = _fuzz(*mid_fit)
    assert accepted >= 10 and fits == 8, f"only {accepted} of 120 mutations loaded: the fuzz tested too little"


def test_the_fuzz_fails_when_load_accepts_a_state_that_then_fails_in_fit(mid_fit, monkeypatch):
    "The control: with the training state's validation off, a malformed state passes load and the fuzz says so."
    monkeypatch.setattr(fr.trainstate, "validate", lambda train: None)
    with pytest.raises(AssertionError, match="passed load, then fit failed"):
        _fuzz(*mid_fit, n=60, trained=60)


AUTO = """
import os, sys, time
sys.path.insert(0, {tests!r})
import fastai_resume
from fastai.callback.core import Callback
from trainer import build
class Slow(Callback):
    def after_batch(self):
        time.sleep({sleep})
        if {hold!r} and os.path.exists({hold!r}):  # held mid-fit while that file exists, saying so
            open({hold!r} + ".reached", "w").close()
            while os.path.exists({hold!r}):
                time.sleep(0.05)
learn = build({path!r}, noise=False, extra_cbs=[fastai_resume.AutoCheckpoint(every_iters=10, keep=2), Slow()])
with learn.no_bar(): learn.fit_one_cycle({epochs}, {lr})
print("trained", len(learn.recorder.losses))
"""


def auto(path, lr=1e-2, epochs=2, sleep=0.0, wait=True, hold=""):
    code = AUTO.format(
        tests=os.path.dirname(os.path.abspath(__file__)), path=str(path), lr=lr, epochs=epochs, sleep=sleep, hold=hold
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        env=dict(ENV, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if not wait:
        return p
    out = p.communicate(timeout=900)[0]
    return p.returncode, out


def test_autoresume_never_takes_or_deletes_another_runs_files(tmp_path):
    rc, out = auto(tmp_path, lr=1e-2)
    assert rc == 0 and "trained 92" in out
    theirs = sorted((tmp_path / "models").glob("auto-*.frk"))  # two checkpoints and the stage's end state
    assert len(theirs) == 3 and sum(p.name.endswith("-end.frk") for p in theirs) == 1
    before = {p: p.read_bytes() for p in theirs}
    rc, out = auto(tmp_path, lr=3e-3)  # the same model, another learning rate: another run
    assert rc == 0 and "AutoCheckpoint: found" not in out and "trained 92" in out
    assert all(p.read_bytes() == b for p, b in before.items())
    assert len(list((tmp_path / "models").glob("auto-*.frk"))) == 6  # per run: 2 checkpoints, 1 stage end


@pytest.mark.slow
def test_a_second_launch_on_the_same_run_is_refused_and_the_first_finishes(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    first = auto(tmp_path, epochs=3, wait=False, hold=str(hold))  # held after its first batch until the second ends
    while not (tmp_path / "hold.reached").exists():
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.05)
    rc, out = auto(tmp_path, epochs=3)
    hold.unlink()
    assert rc != 0 and "is already training this run" in out
    rest = first.communicate(timeout=900)[0]
    assert first.returncode == 0 and "trained 138" in rest, rest
    assert not list((tmp_path / "models").glob(".*.tmp.*"))


def test_a_transient_error_at_autoresume_is_raised_and_never_renames_good_files(tmp_path, monkeypatch):
    rc, _ = auto(tmp_path, epochs=1)
    assert rc == 0
    files = sorted((tmp_path / "models").glob("auto-*.frk"))
    learn = build(tmp_path, noise=False, extra_cbs=[fr.AutoCheckpoint(every_iters=10, keep=2)])

    def emfile(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(fr.io, "info", emfile)
    with pytest.raises(OSError, match="Too many open files"):
        fit(learn, 1, 1e-2)
    assert sorted((tmp_path / "models").glob("auto-*.frk")) == files
    assert not list((tmp_path / "models").glob("*.corrupt"))


@pytest.fixture
def small_disk(tmp_path):
    "A real file system of 14 MiB (tmpfs), full after three checkpoints of the ballasted model."
    with tmpfs(tmp_path / "disk", "14m") as d:
        yield d


def test_a_full_disk_frees_this_runs_older_checkpoints_and_saves_again(small_disk):
    cb = fr.AutoCheckpoint(every_iters=10, keep=3, background=False)
    learn = build(small_disk, noise=False, extra_cbs=[cb])
    learn.model.register_buffer("ballast", torch.ones(1 << 20))  # 4 MiB in every checkpoint
    fit(learn, 2, 1e-2)
    files = cb.checkpoints()
    assert files and files[-1].name.endswith("-e000002-i0000000000.frk")  # the last save made it
    for p in files:
        fr.info(p, verify=True)
    assert not list((small_disk / "models").glob(".*tmp*"))


def test_on_error_warn_also_applies_to_synchronous_saves(small_disk):
    cb = fr.AutoCheckpoint(every_iters=10, keep=1, background=False, on_error="warn")
    learn = build(small_disk, noise=False, extra_cbs=[cb])
    learn.model.register_buffer("ballast", torch.ones(4 << 20))  # 16 MiB: no checkpoint fits
    with pytest.warns(UserWarning, match="No space left on device"):
        fit(learn, 1, 1e-2)
    assert len(learn.recorder.losses) == 46  # training went on
    assert not list((small_disk / "models").glob(".*tmp*"))


def test_temp_files_of_killed_saves_are_removed_when_their_process_is_gone(tmp_path):
    learn = build(tmp_path, noise=False)
    fit(learn, 1, 1e-2)
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = models / f".m.frk.tmp.{dead.stdout.strip()}.0"
    live = models / f".m.frk.tmp.{os.getppid()}.0"  # a process that is still running
    stale.write_bytes(b"partial"), live.write_bytes(b"in flight")
    learn.save("m", with_iter=True)
    assert not stale.exists() and live.exists()


def test_planted_temporary_names_cannot_block_a_save(tmp_path):
    """Another user of the folder creates, before the save, every temporary name the old scheme
    (`.<name>.tmp.<pid>.<n>`, n = 0, 1, ...) would try and a thousand of the new form: saves, in this
    process and from a background writer thread, still succeed, and no planted file is touched."""
    from fastai_resume.snapshot import BackgroundCommit

    rnd = random.Random(0)
    planted = {}
    for name in ("ck.frk", "bg.frk"):
        for n in range(200):
            planted[tmp_path / f".{name}.tmp.{os.getpid()}.{n}"] = b"old scheme"
        for _ in range(1000):
            planted[tmp_path / f".{name}.tmp.{os.getpid()}.{rnd.getrandbits(64):016x}"] = b"guessed"
    for p, data in planted.items():
        p.write_bytes(data)
    tree = {"w": torch.arange(1000.0), "step": 3}
    fr.save(tree, tmp_path / "ck.frk")
    BackgroundCommit(tree, tmp_path / "bg.frk").wait()
    for name in ("ck.frk", "bg.frk"):
        back = fr.load(tmp_path / name)
        assert back["step"] == 3 and torch.equal(back["w"], tree["w"])
    assert {p: p.read_bytes() for p in planted} == planted
    assert sorted(p.name for p in tmp_path.iterdir() if p not in planted) == ["bg.frk", "ck.frk"]


def test_a_killed_writers_random_temporary_name_is_recognised_and_removed(tmp_path):
    "A real writer killed mid-save leaves `.<name>.tmp.<pid>.<16 hex digits>`; its pid still marks it as dead."
    import re
    import time

    code = (
        "import sys, torch, fastai_resume as fr\nt = {'w': torch.zeros(8 << 20)}\nwhile True: fr.save(t, sys.argv[1])\n"
    )
    for _ in range(5):  # a kill that lands between a rename and the next save leaves no temp file: again
        p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m.frk")], env=ENV)
        try:
            deadline = time.monotonic() + 120
            temps: list = []
            while not temps and time.monotonic() < deadline and p.poll() is None:
                temps = [n for n in os.listdir(tmp_path) if n.startswith(".m.frk.tmp.")]
            p.kill()
        finally:
            p.kill()
            p.wait()
        left = [n for n in os.listdir(tmp_path) if n.startswith(".m.frk.tmp.")]
        if left:
            break
    assert left and re.fullmatch(rf"\.m\.frk\.tmp\.{p.pid}\.[0-9a-f]{{16}}", left[0]), left
    assert fr.stored.remove_dead_temps(tmp_path) == 1
    assert [n for n in os.listdir(tmp_path) if n != "m.frk"] == []  # (killed before its first rename: no m.frk)
