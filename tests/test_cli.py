"""The command-line tool, run as a user runs it (a new process, no warning filters), the demo's
pieces, and the notebook (executed top to bottom).

The tool's contract: it prints its output and nothing else; an expected user error is one line on
stderr that names the file and says what is wrong, with exit status 2 and no traceback; `verify`
prints one line per file and exits 1 when a file is not a valid checkpoint.
"""

import json
import os
import random
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from test_hostile import Child, crashed, hostile_cases, pickle_files
from test_resume_rules import StopAt
from trainer import build

import fastai_resume as fr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
ENV["PYTHONPATH"] = ROOT


def cli(*args, python_opts=()):
    p = subprocess.run(
        [sys.executable, *python_opts, "-m", "fastai_resume", *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr


def one_error_line(err, cmd):
    "The message of stderr's one line, `fastai-resume CMD: error: MESSAGE` (no traceback, nothing else)."
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = f"fastai-resume {cmd}: error: "
    assert lines[0].startswith(prefix), err
    return lines[0][len(prefix) :]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A learner's folder holding a mid-fit checkpoint (ck.frk) and fastai's own save (vanilla.pth)."
    d = tmp_path_factory.mktemp("cli")
    learn = build(d, noise=False)
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(3, 1e-2, cbs=StopAt(1, 10))
    learn.save("vanilla")  # a plain save: fastai's own torch.save file, model and optimizer
    return d / "models"


@pytest.fixture(scope="module")
def ckpt(run):
    return run / "ck.frk"


@pytest.fixture(scope="module")
def vanilla(run):
    assert (run / "vanilla.pth").read_bytes()[:4] == b"PK\x03\x04"
    return run / "vanilla.pth"


# The inputs a user may name by mistake: how to make each, and what the one error line must say.
def make_bad(kind, folder, ckpt, vanilla):
    p = folder / {"vanilla": "model.pth", "folder": "models"}.get(kind, f"{kind}.frk")
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated":
        p.write_bytes(ckpt.read_bytes()[:4])
    elif kind == "cut_in_half":
        p.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    elif kind == "random":
        p.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "text":
        p.write_text("epoch train_loss valid_loss accuracy time\n0 0.31 0.22 0.93 00:01\n" * 20)
    elif kind == "vanilla":
        p.write_bytes(vanilla.read_bytes())
    elif kind == "folder":
        p.mkdir()
    return p


REASON = {
    "missing": "No such file or directory",
    "empty": "is 0 bytes, too short to be a checkpoint (truncated?)",
    "truncated": "is 4 bytes, too short to be a checkpoint (truncated?)",
    "cut_in_half": "no valid footer: the file is incomplete or truncated",
    "random": "not a fastai_resume checkpoint (no magic bytes)",
    "text": "not a fastai_resume checkpoint (no magic bytes)",
    "vanilla": "a torch.save file (such as a vanilla fastai .pth), not a fastai_resume checkpoint",
    "folder": "is a folder, not a file",
}


@pytest.mark.parametrize("kind", list(REASON))
def test_inspect_of_a_file_that_is_not_a_checkpoint_is_one_error_line(kind, tmp_path, ckpt, vanilla):
    bad = make_bad(kind, tmp_path, ckpt, vanilla)
    rc, out, err = cli("inspect", bad)
    assert rc == 2 and out == ""
    msg = one_error_line(err, "inspect")
    assert str(bad) in msg and REASON[kind] in msg


@pytest.mark.parametrize("kind", [k for k in REASON if k != "vanilla"])  # a vanilla .pth is convert's input
def test_convert_of_a_file_that_is_not_a_checkpoint_is_one_error_line_and_writes_nothing(kind, tmp_path, ckpt, vanilla):
    bad = make_bad(kind, tmp_path, ckpt, vanilla)
    before = set(os.listdir(tmp_path))
    rc, out, err = cli("convert", bad, tmp_path / "out.pth")
    assert rc == 2 and out == ""
    msg = one_error_line(err, "convert")
    reason = {
        "random": "neither a fastai_resume checkpoint (no magic bytes) nor a torch.save file",
        "text": "neither a fastai_resume checkpoint (no magic bytes) nor a torch.save file",
    }.get(kind, REASON[kind])
    assert str(bad) in msg and reason in msg
    assert set(os.listdir(tmp_path)) == before  # no output, no temporary file


@pytest.mark.parametrize("kind", [k for k in REASON if k not in ("missing", "folder")])
def test_verify_of_a_named_file_that_is_not_a_valid_checkpoint_fails(kind, tmp_path, ckpt, vanilla):
    bad = make_bad(kind, tmp_path, ckpt, vanilla)
    rc, out, err = cli("verify", bad)
    assert rc == 1 and err == ""
    assert out.startswith(f"BAD  {bad}: ") and out.count("\n") == 1 and REASON[kind] in out


def test_verify_of_a_missing_path_is_one_error_line(tmp_path):
    rc, out, err = cli("verify", tmp_path / "ckpt.frk")
    assert rc == 2 and out == ""
    assert one_error_line(err, "verify") == f"{tmp_path / 'ckpt.frk'}: No such file or directory"


def test_verify_of_a_good_checkpoint_is_one_ok_line(ckpt):
    rc, out, err = cli("verify", ckpt)
    assert (rc, out, err) == (0, f"OK   {ckpt}\n", "")


def test_verify_of_a_folder_checks_checkpoints_skips_other_files_and_sums_up(ckpt, vanilla, tmp_path):
    (tmp_path / "good.frk").write_bytes(ckpt.read_bytes())
    (tmp_path / "good-too.pth").write_bytes(ckpt.read_bytes())  # our format, told by content not name
    flipped = bytearray(ckpt.read_bytes())
    flipped[200] ^= 1
    (tmp_path / "flipped.frk").write_bytes(bytes(flipped))
    (tmp_path / "cut.frk").write_bytes(ckpt.read_bytes()[:4])  # named as ours: a broken checkpoint, not a stranger
    (tmp_path / "vanilla.pth").write_bytes(vanilla.read_bytes())
    (tmp_path / "notes.txt").write_text("lr 1e-3\n" * 10)
    (tmp_path / f".auto-f000-e000001-i0000000010.frk.tmp.{os.getpid()}.0").write_bytes(ckpt.read_bytes()[:300])
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "pipe.frk")  # opening it for reading would block: it is never opened
    rc, out, err = cli("verify", tmp_path)
    assert rc == 1 and err == ""
    lines = out.splitlines()
    assert lines[-1] == "2 ok, 2 bad, 5 skipped"
    status = {line.split()[1].rstrip(":").rsplit("/", 1)[1]: line.split()[0] for line in lines[:-1]}
    assert status == {
        "good.frk": "OK",
        "good-too.pth": "OK",
        "flipped.frk": "BAD",
        "cut.frk": "BAD",
        "vanilla.pth": "SKIP",
        "notes.txt": "SKIP",
        "sub": "SKIP",
        "pipe.frk": "SKIP",
        f".auto-f000-e000001-i0000000010.frk.tmp.{os.getpid()}.0": "SKIP",
    }
    assert f"BAD  {tmp_path / 'flipped.frk'}: " in out and "checksum" in out.lower()


def test_verify_of_a_folder_of_good_checkpoints_exits_0(ckpt, vanilla, tmp_path):
    (tmp_path / "a.frk").write_bytes(ckpt.read_bytes())
    (tmp_path / "b.pth").write_bytes(vanilla.read_bytes())
    rc, out, err = cli("verify", tmp_path)
    assert rc == 0 and err == "" and out.splitlines()[-1] == "1 ok, 0 bad, 1 skipped"


def test_verify_of_a_folder_without_checkpoints_is_an_error(vanilla, tmp_path):
    (tmp_path / "b.pth").write_bytes(vanilla.read_bytes())
    rc, out, err = cli("verify", tmp_path)
    assert rc == 2 and out.splitlines()[-1] == "0 ok, 0 bad, 1 skipped"
    assert (
        one_error_line(err, "verify")
        == f"{tmp_path}: no fastai_resume checkpoint in this folder (1 other entry skipped)"
    )


def test_inspect_shows_position_tensors_and_verification(ckpt):
    rc, out, err = cli("inspect", ckpt)
    assert rc == 0 and err == ""
    assert "all checksums verify" in out and "epoch 1 of 3, 10 of 46 training batches done" in out
    assert "model.0.weight" in out and "torch.float32" in out and "[128, 64]" in out


def test_inspect_of_a_checkpoint_with_a_bad_checksum_shows_it_and_exits_1(ckpt, tmp_path):
    data = bytearray(ckpt.read_bytes())
    data[200] ^= 1
    (tmp_path / "flipped.frk").write_bytes(bytes(data))
    rc, out, err = cli("inspect", tmp_path / "flipped.frk")
    assert rc == 1 and err == ""
    assert "CHECKSUM FAILURE" in out.splitlines()[0] and "model.0.weight" in out


def test_convert_to_vanilla_pth_and_back(ckpt, tmp_path):
    rc, out, err = cli("convert", ckpt, tmp_path / "deploy.pth")
    assert (rc, err) == (0, "") and out.startswith(f"wrote {tmp_path / 'deploy.pth'}")
    assert [p.name for p in tmp_path.iterdir()] == ["deploy.pth"]  # no temporary file left
    learn = build(tmp_path, noise=False)
    learn.load(tmp_path / "deploy")  # fastai's own loader
    ref = fr.load(ckpt)["model"]
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in ref.items())
    rc, _, err = cli("convert", tmp_path / "deploy.pth", tmp_path / "back.frk")
    assert (rc, err) == (0, "")
    back = fr.load(tmp_path / "back.frk")
    assert all(torch.equal(v, back["model"][k]) for k, v in ref.items()) and "train" not in back


def test_convert_of_a_vanilla_fastai_save_keeps_model_and_optimizer_state(vanilla, tmp_path):
    rc, _, err = cli("convert", vanilla, tmp_path / "v.frk")
    assert (rc, err) == (0, "")
    ref = torch.load(vanilla, weights_only=False)  # (a file this test wrote itself)
    got = fr.load(tmp_path / "v.frk")
    assert all(torch.equal(v, got["model"][k]) for k, v in ref["model"].items())
    assert got["opt"]["hypers"] == [{k: float(v) for k, v in h.items()} for h in ref["opt"]["hypers"]]
    assert type(ref["opt"]["hypers"][0]["lr"]).__module__ == "numpy"  # what the safe load had to allow
    n = sum(isinstance(v, torch.Tensor) for s in ref["opt"]["state"] for v in s.values())
    assert n > 0 and n == sum(isinstance(v, torch.Tensor) for s in got["opt"]["state"] for v in s.values())


def test_convert_reads_a_pth_written_under_numpy_1(vanilla, tmp_path):
    "NumPy 1 pickled its scalars as numpy.core.multiarray.scalar; NumPy 2 as numpy._core.multiarray.scalar."
    old = tmp_path / "numpy1.pth"
    with zipfile.ZipFile(vanilla) as src, zipfile.ZipFile(old, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray\nscalar" in data
                data = data.replace(b"numpy._core.multiarray\nscalar", b"numpy.core.multiarray\nscalar")
            dst.writestr(item, data)
    assert "numpy.core.multiarray.scalar" in torch.serialization.get_unsafe_globals_in_checkpoint(old)
    rc, _, err = cli("convert", old, tmp_path / "v.frk")
    assert (rc, err) == (0, "")
    assert fr.load(tmp_path / "v.frk")["opt"]["hypers"][0]["lr"] == float(
        torch.load(vanilla, weights_only=False)["opt"]["hypers"][0]["lr"]
    )


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_convert_never_runs_code_from_a_pth(tmp_path):
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.pth"
    torch.save({"model": {"w": torch.ones(2)}, "opt": _Payload(marker)}, hostile)
    rc, out, err = cli("convert", hostile, tmp_path / "out.frk")
    assert rc == 2 and out == "" and not marker.exists() and not (tmp_path / "out.frk").exists()
    msg = one_error_line(err, "convert")
    assert msg.startswith(f"{hostile}: holds posix.system, not only tensors") and "not loaded" in msg


def test_convert_model_only_drops_the_optimizer_both_ways(ckpt, vanilla, tmp_path):
    assert cli("convert", "--model-only", ckpt, tmp_path / "m.pth")[0] == 0
    sd = torch.load(tmp_path / "m.pth", weights_only=True)
    assert set(sd) == set(fr.load(ckpt)["model"])  # a bare state dict
    assert cli("convert", "--model-only", vanilla, tmp_path / "m.frk")[0] == 0
    assert set(fr.load(tmp_path / "m.frk")) == {"fastai_resume", "model"}


def test_convert_refuses_files_that_hold_no_model(tmp_path):
    fr.save({"losses": [1.0, 2.0]}, tmp_path / "tree.frk")
    torch.save([torch.ones(2)], tmp_path / "list.pth")
    rc, _, err = cli("convert", tmp_path / "tree.frk", tmp_path / "o.pth")
    assert (
        rc == 2
        and one_error_line(err, "convert")
        == f"{tmp_path / 'tree.frk'}: a fastai_resume file, but not a Learner checkpoint (no 'model')"
    )
    rc, _, err = cli("convert", tmp_path / "list.pth", tmp_path / "o.frk")
    assert rc == 2 and "a torch.save file, but not a fastai model" in one_error_line(err, "convert")


def test_convert_to_a_bad_destination_is_one_error_line(ckpt, tmp_path):
    for dst, reason in [
        (tmp_path / "no" / "o.pth", f"folder {tmp_path / 'no'} does not exist"),
        (tmp_path, "is a folder; name the file to write"),
        (ckpt, "is the source file; name another file"),
    ]:
        rc, out, err = cli("convert", ckpt, dst)
        assert rc == 2 and out == "" and one_error_line(err, "convert") == f"{dst}: {reason}"
    assert fr.load(ckpt)["model"]  # the source is untouched


def test_the_cli_prints_its_output_and_nothing_else(ckpt, vanilla, tmp_path):
    "No warning of any kind (turned into errors here), and fastai is never imported."
    runs = [
        ("inspect", ckpt),
        ("verify", ckpt.parent),
        ("convert", ckpt, tmp_path / "a.pth"),
        ("convert", vanilla, tmp_path / "b.frk"),
    ]
    for args in runs:
        rc, out, err = cli(*args, python_opts=("-W", "error", "-X", "importtime"))
        imported = [line.rsplit("|", 1)[1].strip() for line in err.splitlines() if line.startswith("import time:")]
        assert rc == 0 and out, (args, err)
        assert [line for line in err.splitlines() if not line.startswith("import time:")] == [], args
        assert "torch" in imported and not [m for m in imported if m.split(".")[0] == "fastai"], args


def test_the_installed_script_is_as_quiet(ckpt, tmp_path):
    "`fastai-resume` as pip writes it: imports main from the package and exits with its status."
    script = tmp_path / "fastai-resume"
    script.write_text("import sys\nfrom fastai_resume.__main__ import main\nsys.exit(main())\n")
    p = subprocess.run([sys.executable, str(script), "verify", str(ckpt)], capture_output=True, text=True, env=ENV)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"OK   {ckpt}\n", "")


# ---- hostile files through every command ----------------------------------------------------------

_DROP = object()


def _put(node, path, value):
    "`node` with the value at `path` replaced by `value` (or removed: `_DROP`); only the containers on the path are new."
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(node, dict):
        out = dict(node)
        if rest or value is not _DROP:
            out[k] = _put(node[k], rest, value)
        else:
            del out[k]
        return out
    items = list(node)
    items[k] = _put(node[k], rest, value)
    return type(node)(items)


def _wrong(v):
    "A value of another kind where `v` was: a list for a dict, a dict for a list, a str for a number, ..."
    if isinstance(v, dict):
        return list(v.values())
    if isinstance(v, (list, tuple)):
        return dict(enumerate(v))
    if isinstance(v, torch.Tensor):
        return v.reshape(-1)[:8].tolist()
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v.copy())  # a tensor where an array was
    if isinstance(v, str):
        return 7
    if v is None:
        return "None"
    return str(v)  # bool, int, float


def tree_mutations(tree):
    """(name, tree) for each change of one node of a Learner checkpoint's training state to another kind
    (every field, in lists of fewer than 50 items), each removal of a dict's field, and the top level's."""
    train = tree["train"]
    out = [
        ("tree_is_a_list", list(tree.values())),
        ("train_is_a_list", _put(tree, ("train",), list(train.values()))),
        ("model_is_a_list", _put(tree, ("model",), list(tree["model"].values()))),
        ("opt_is_a_list", _put(tree, ("opt",), [tree["opt"]])),
        ("schema_is_a_str", _put(tree, ("fastai_resume",), "3")),
        ("schema_is_a_bool", _put(tree, ("fastai_resume",), True)),
        ("schema_from_the_future", _put(tree, ("fastai_resume",), 99)),
        ("no_schema", _put(tree, ("fastai_resume",), _DROP)),
    ]

    def walk(v, path, parent_is_dict):
        if path:
            name = "train" + "".join(f"[{k!r}]" for k in path)
            out.append(
                (f"{name}={type(v).__name__}->{type(_wrong(v)).__name__}", _put(tree, ("train", *path), _wrong(v)))
            )
            if parent_is_dict:
                out.append((f"{name}:removed", _put(tree, ("train", *path), _DROP)))
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, (*path, k), True)
        elif isinstance(v, (list, tuple)) and len(v) < 50:
            for i, x in enumerate(v):
                walk(x, (*path, i), False)

    walk(train, (), False)
    return out


CLI_FUZZ_CHILD = r"""
import contextlib, io, traceback, warnings
from fastai_resume import checkpoint
from fastai_resume.__main__ import main
cases, scratch = json.loads(open(sys.argv[1]).read()), sys.argv[2]
for name, path in cases:
    print("CASE " + name, flush=True)  # a crash leaves this as the last line
    try:
        checkpoint.read(path)  # what learn.load checks before it looks at the learner
        loads = "ok"
    except fr.CheckpointError:
        loads = "refused"
    except BaseException as e:
        loads = "load raised " + type(e).__name__ + ": " + str(e)[:300]
    runs = {}
    for cmd in (["inspect", path], ["verify", path], ["convert", path, scratch]):
        out, err = io.StringIO(), io.StringIO()
        with warnings.catch_warnings(record=True) as seen, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                rc = main(cmd)  # what `python -m fastai_resume` runs: sys.exit(main())
            except SystemExit as e:
                rc = e.code
            except BaseException:
                rc = None  # an interpreter would print this traceback and exit 1
                err.write(traceback.format_exc())
        for w in seen:
            err.write(f"{w.category.__name__}: {w.message}\n")
        runs[cmd[0]] = [rc, out.getvalue()[:3000], err.getvalue()[-3000:]]  # the head: verify's line begins OK/BAD, and a long path (CI's) pushed that out of a tail
        if os.path.exists(scratch):
            os.unlink(scratch)
    print("R " + json.dumps([name, loads, runs]), flush=True)
emit("done")
"""


def test_every_command_treats_a_files_tree_as_untrusted(ckpt, tmp_path):
    """The hostile files `load` is tested with (tests/test_hostile.py's: structure with valid checksums,
    pickle payloads) and a real mid-fit checkpoint with each field of its training state changed to
    another kind or removed, through inspect, verify and convert: never a traceback, a warning or an
    error of more than one line; a tree `load` refuses is BAD for verify and exit 2 for the others,
    one `load` accepts is shown and converted as it is."""
    want = {}  # name -> (path, expected exit status of inspect, verify, convert); None: as load decides
    for name, (data, (kind, _)) in hostile_cases().items():
        p = tmp_path / f"format-{name}.frk"
        p.write_bytes(data)
        want[f"format-{name}"] = (p, (2, 1, 2) if kind == "corrupt" else (0, 0, 2))  # controls: not a Learner's
    (tmp_path / "pickles").mkdir()
    marker, files, _ = pickle_files(tmp_path / "pickles")
    for name, p in files.items():
        want[f"pickle-{name}"] = (p, (0, 0, 2) if name == "valid_with_pickles" else (2, 1, 2))
    tree = fr.load(ckpt)
    for i, (name, t) in enumerate(tree_mutations(tree)):
        p = tmp_path / f"tree-{i}.frk"
        fr.save(t, p)
        want[f"tree-{name}"] = (p, (0, 0, 2) if name == "tree_is_a_list" else None)
    listing = tmp_path / "cases.json"
    listing.write_text(json.dumps([[name, str(p)] for name, (p, _) in want.items()]))
    child = Child("cli-fuzz", CLI_FUZZ_CHILD, listing, tmp_path / "converted", workdir=tmp_path)
    rc, res, out, stdout = child.result(timeout=600)
    assert rc == 0 and res == "done", crashed(rc, out)
    results = {
        name: (loads, runs)
        for name, loads, runs in (json.loads(ln[2:]) for ln in stdout.splitlines() if ln.startswith("R "))
    }
    assert set(results) == set(want)
    refused, wrong = 0, []
    for name, (path, expected) in want.items():
        loads, runs = results[name]
        if loads not in ("ok", "refused"):  # load's own checks raise nothing else
            wrong.append(f"{name}: load: {loads}")
        if expected is None:  # a Learner checkpoint: the tool refuses what load refuses, and only that
            expected = (2, 1, 2) if loads == "refused" else (0, 0, 0)
            refused += loads == "refused"
        for cmd, status in zip(("inspect", "verify", "convert"), expected):
            code, cmd_out, err = runs[cmd]
            lines = err.splitlines()
            if code != status or "Traceback" in err:
                wrong.append(f"{name}: {cmd} exited {code}, expected {status}: {(err or cmd_out)[-600:]}")
            elif status == 2 and not (
                len(lines) == 1 and lines[0].startswith(f"fastai-resume {cmd}: error: ") and str(path) in lines[0]
            ):
                wrong.append(f"{name}: {cmd}: not one error line naming the file: {err}")
            elif status != 2 and err:
                wrong.append(f"{name}: {cmd}: wrote to stderr: {err}")
            elif cmd == "verify" and not cmd_out.startswith(("OK   " if status == 0 else "BAD  ") + str(path)):
                wrong.append(f"{name}: verify: {cmd_out}")
    assert not wrong, f"{len(wrong)} wrong:\n" + "\n".join(wrong)
    assert results["tree-train_is_a_list"][0] == "refused"  # the case the issue found
    assert refused > 100  # most changes of a training state's shape are refused, each one by every command
    assert not os.path.exists(marker)  # no payload ran


def test_a_training_state_that_is_a_list_is_one_error_line_for_every_command(ckpt, tmp_path):
    "The issue's file, through the tool as a user runs it: a valid file whose training state is a list."
    tree = fr.load(ckpt)
    tree["train"] = list(tree["train"].values())
    bad = tmp_path / "list.frk"
    fr.save(tree, bad)
    reason = f"{bad}: malformed training state: train: expected a dict, got list"
    for args in (("inspect", bad), ("convert", bad, tmp_path / "o.pth")):
        rc, out, err = cli(*args)
        assert (rc, out) == (2, "") and one_error_line(err, args[0]) == reason
    assert cli("verify", bad) == (1, f"BAD  {bad}: malformed training state: train: expected a dict, got list\n", "")
    assert sorted(os.listdir(tmp_path)) == ["list.frk"]


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel is a new process
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "identical to the uninterrupted run: True" in outputs
