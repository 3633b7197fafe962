"""The value-tree format through the Python API: every dtype and tree kind round-trips exactly,
storage sharing survives, loaded tensors are zero-copy views that outlive their file, and
anything unstorable fails at save time naming where it is."""

import os

import numpy as np
import pytest
import torch

import fastai_resume as fr
from fastai_resume import _core


def roundtrip(tree, tmp_path, **kw):
    p = tmp_path / "t.frk"
    fr.save(tree, p)
    return fr.load(p, **kw)


FLOAT8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
]
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
] + FLOAT8


def same_bits(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_torch_dtype_round_trips_bitwise(dtype, tmp_path):
    raw = torch.randint(0, 256, (6, 5 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8)
    t = raw.view(dtype)
    back = roundtrip({"t": t}, tmp_path)["t"]
    assert same_bits(t, back)


def test_zero_dim_empty_and_noncontiguous_tensors_keep_shape_and_strides(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tree = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "t": base.t(),
        "slice": base[1:, ::2],
        "rows_overlap_but_fit": base.view(-1).as_strided((3, 6), (6, 1), 6),
    }
    back = roundtrip(tree, tmp_path)
    for k, v in tree.items():
        assert torch.equal(v, back[k]) and back[k].shape == v.shape and back[k].stride() == v.stride(), k


def test_an_expanded_tensor_is_stored_as_a_copy_and_round_trips_equal(tmp_path):
    "A view holding more elements than its storage (expand: stride 0) is stored contiguous."
    col = torch.arange(3.0).view(3, 1)
    tree = {"expanded": col.expand(3, 1000), "broadcast": torch.tensor(7.0).expand(50, 50)}
    back = roundtrip(tree, tmp_path)
    for k, v in tree.items():
        assert torch.equal(back[k], v) and back[k].shape == v.shape and back[k].is_contiguous(), k
    assert (tmp_path / "t.frk").stat().st_size > 4 * (3 * 1000 + 50 * 50)  # the copies' bytes


def test_shared_storage_stays_shared_like_tied_weights(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    sd = {"emb.weight": emb.weight.detach(), "head.weight": head.weight.detach(), "view": emb.weight.detach()[2:5]}
    back = roundtrip(sd, tmp_path)
    assert back["emb.weight"].untyped_storage().data_ptr() == back["head.weight"].untyped_storage().data_ptr()
    back["emb.weight"][3, 0] = 123.0
    assert back["head.weight"][3, 0] == 123.0 and back["view"][1, 0] == 123.0
    assert os.path.getsize(tmp_path / "t.frk") < 2 * 10 * 4 * 4 + 1024  # one blob, not two


def test_python_values_and_containers_round_trip(tmp_path):
    tree = {
        "none": None,
        "t": True,
        "f": False,
        "i": -(2**63),
        "big": 2**63 - 1,
        "x": 1.5,
        "nan": float("nan"),
        "s": "héllo ✓",
        "b": b"\x00\xff",
        "l": [1, [2, [3]]],
        "tup": (1, "a", (None,)),
        7: "int key",
        "nested": {"a": {"b": {"c": []}}},
    }
    back = roundtrip(tree, tmp_path)
    nan = back.pop("nan")
    assert nan != nan
    tree.pop("nan")
    assert back == tree and isinstance(back["tup"], tuple) and isinstance(back["l"], list)


def test_long_sequences_of_ints_are_written_as_one_by_one_and_others_keep_their_kinds(tmp_path):
    """An RNG's state (hundreds of ints) goes to the writer in one call (`Writer.put_ints`): the file is the
    one the value-by-value walk writes, byte for byte; a sequence with a bool, a float or an int wider than
    64 bits among its ints is walked value by value (the bool stays a bool; the wide int is refused, by path)."""
    import random

    from fastai_resume import io

    class OneByOne:  # the writer, less its `put_ints`: the walk's own path
        def __init__(self, w):
            self.w = w

        def __getattr__(self, name):
            return (lambda seq: False) if name == "put_ints" else getattr(self.w, name)

    tree = {
        "python": random.getstate(),
        "l": list(range(-(2**63), -(2**63) + 20)),
        "bools": [True, False] * 4 + [1, 0],
        "floats": [1.5] + list(range(9)),
        "short": (1, 2, 3),
    }
    fast, slow = _core.Writer(), _core.Writer()
    io._Encoder(fast).value(tree, "")
    io._Encoder(OneByOne(slow)).value(tree, "")
    fast.commit(str(tmp_path / "fast.frk"), fsync=False)
    slow.commit(str(tmp_path / "slow.frk"), fsync=False)
    assert (tmp_path / "fast.frk").read_bytes() == (tmp_path / "slow.frk").read_bytes()
    back = fr.load(tmp_path / "fast.frk")
    assert back["python"] == tree["python"] and back["l"] == tree["l"] and back["floats"] == tree["floats"]
    assert [type(v) for v in back["bools"]] == [bool] * 8 + [int, int]
    with pytest.raises(TypeError, match=r"\['w'\]\[9\]: int 18446744073709551616 does not fit in 64 bits"):
        fr.save({"w": list(range(9)) + [2**64]}, tmp_path / "x.frk")


def test_the_walk_in_c_writes_the_bytes_of_the_walk_in_python(tmp_path):
    """`io.encode` walks the tree in C (`Writer.put_tree`); the Python walk (`_Encoder.value`) is its
    definition: the same file, byte for byte, for every kind of value and container (subclasses too: an
    OrderedDict in its own order after `move_to_end`, a namedtuple, an IntEnum, NumPy's float64, a str
    subclass), shared tensors, arrays, RNG states; and for a real checkpoint's tree. Where the C walk meets a
    value it cannot store, the Python walk's error names it by path."""
    import collections
    import enum
    import random

    from fastai_resume import io

    class Color(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    Point = collections.namedtuple("Point", "x y")
    od = collections.OrderedDict([("b", 1), ("a", torch.arange(3)), ("c", [1.5, None])])
    od.move_to_end("b")
    shared = torch.randn(4, 4)
    tree = {
        "od": od,
        "nt": Point(1, [2, 3]),
        "enum": Color.RED,
        "np_float": np.float64(2.5),
        "name": Name("x"),
        "kinds": [None, True, False, 0, -(2**63), 2**63 - 1, 1.0, float("inf"), "é", b"\x00b", bytearray(b"ab")],
        "ints": list(range(100)) + [True],
        "rng": random.getstate(),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2],
        "tensors": [shared, shared[1], shared.t(), torch.zeros(0), torch.tensor(3.0)],
        7: {-1: "neg"},
        "deep": [[[[{"x": (1, (2, (3,)))}]]]],
    }

    def both(tree, name):
        fast, slow = io.encode(tree), _core.Writer()
        io._Encoder(slow).value(tree, "")
        fast.commit(str(tmp_path / f"{name}-c.frk"), fsync=False)
        slow.commit(str(tmp_path / f"{name}-py.frk"), fsync=False)
        return (tmp_path / f"{name}-c.frk").read_bytes(), (tmp_path / f"{name}-py.frk").read_bytes()

    c, py = both(tree, "kinds")
    assert c == py
    back = fr.load(tmp_path / "kinds-c.frk")
    assert (
        list(back["od"]) == ["a", "c", "b"]
        and back["nt"] == (1, [2, 3])
        and back["kinds"][3:6] == [0, -(2**63), 2**63 - 1]
    )

    from trainer import build

    learn = build(tmp_path)  # a real training state: a fit's checkpoint, read back
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=fr.AutoCheckpoint(every_iters=20, keep=1))
    tree = fr.load(sorted((tmp_path / "models").glob("*.frk"))[-1])
    c, py = both(tree, "checkpoint")
    assert c == py and len(c) > 1000

    class Mine:
        pass

    for bad, match in [
        ({"a": [1, {"b": Mine()}]}, r"\['a'\]\[1\]\['b'\]: .*Mine is not storable"),
        ({"a": list(range(9)) + [2**64]}, r"\['a'\]\[9\]: int .* does not fit in 64 bits"),
        ({"a": {True: 1}}, r"\['a'\]: dict key True \(bool\) is not storable"),
        ({"a": [torch.eye(2).to_sparse()]}, r"\['a'\]\[0\]: .*sparse"),
    ]:
        with pytest.raises(TypeError, match=match):
            io.encode(bad)


def test_numpy_arrays_round_trip_with_dtype_and_strides(tmp_path):
    arrs = {
        "i": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
        "f": np.random.rand(5).astype(np.float16),
        "c": np.array([1 + 2j], dtype=np.complex128),
        "bool": np.array([True, False]),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "u32": np.array(7, dtype=np.uint32),
    }
    back = roundtrip(arrs, tmp_path)
    for k, a in arrs.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and np.array_equal(back[k], a), k


def test_same_tensor_twice_loads_as_one_object(tmp_path):
    t = torch.randn(3)
    back = roundtrip({"a": t, "b": [t]}, tmp_path)
    assert back["a"] is back["b"][0]


def test_unstorable_value_fails_at_save_naming_its_path(tmp_path):
    class MyClass:
        pass

    with pytest.raises(TypeError, match=r"\['opt'\]\['state'\]\[3\]\['foo'\]: .*MyClass is not storable"):
        fr.save({"opt": {"state": [0, 1, 2, {"foo": MyClass()}]}}, tmp_path / "x.frk")
    assert not (tmp_path / "x.frk").exists()
    with pytest.raises(TypeError, match="does not fit in 64 bits"):
        fr.save([2**64], tmp_path / "x.frk")
    with pytest.raises(TypeError, match="keys must be str or int"):
        fr.save({(1, 2): 3}, tmp_path / "x.frk")
    with pytest.raises(TypeError, match="sparse"):
        fr.save(torch.eye(3).to_sparse(), tmp_path / "x.frk")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mmap", [False, True])
def test_loaded_tensors_outlive_their_file_and_writing_them_never_changes_it(tmp_path, mmap):
    p = tmp_path / "t.frk"
    fr.save({"w": torch.arange(1000.0)}, p)
    w = fr.load(p, mmap=mmap)["w"]
    os.remove(p)  # deleting (or atomically replacing) the file is safe in both modes
    fr.save({"w": torch.zeros(1000)}, p)
    assert w.sum().item() == sum(range(1000))
    w += 1  # private memory (or copy-on-write): the file is not changed
    assert fr.load(p)["w"].sum().item() == 0


CHANGED_FILE_CHILD = r"""
import os, sys
import numpy as np, torch
import fastai_resume as fr
p, mmap = sys.argv[1], sys.argv[2] == "1"
tree = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.arange(7),
        "n": np.arange(5000, dtype=np.int64), "view": None}
tree["view"] = tree["w"][10:20]
fr.save(tree, p)
back = fr.load(p, mmap=mmap)
os.truncate(p, 0)                        # truncate(1) over the loaded file,
with open(p, "wb") as f:                 # then cp(1) other bytes into the same inode
    f.write(b"\xff" * (1 << 20))
ok = (torch.equal(back["w"], tree["w"]) and torch.equal(back["b"], tree["b"])
      and np.array_equal(back["n"], tree["n"]) and torch.equal(back["view"], tree["view"]))
back["w"] += 1; back["b"] += 1; back["n"] += 1
ok = ok and back["w"][-1].item() == 300_000 and back["view"][0].item() == 11 and back["n"][-1] == 5000
print("OK" if ok else "CHANGED", flush=True)
"""


@pytest.mark.parametrize("mmap", [False, True])
def test_loaded_memory_is_the_process_own_when_the_file_is_truncated_and_rewritten(tmp_path, mmap):
    """load() reads the file into memory of its own: truncating or rewriting the loaded file in
    place changes nothing. The control, mmap=True, shows the hazard that default avoids: the
    views read the inode, and the process dies of SIGBUS (run in a child, so pytest survives)."""
    import signal
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", CHANGED_FILE_CHILD, str(tmp_path / "t.frk"), str(int(mmap))],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))),
    )
    if mmap:
        assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr[-2000:])
    else:
        assert r.returncode == 0 and r.stdout.strip() == "OK", (r.returncode, r.stdout, r.stderr[-2000:])


def test_verify_false_skips_blob_checksums_but_not_the_index(tmp_path):
    p = tmp_path / "t.frk"
    fr.save({"w": torch.zeros(1000)}, p)
    blob_off = fr.info(p)["blobs"][0][0]
    data = bytearray(p.read_bytes())
    data[blob_off + 10] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(fr.CheckpointError, match="checksum mismatch in blob 0"):
        fr.load(p)
    assert fr.load(p, verify=False)["w"].count_nonzero().item() == 1
    idx_off = int.from_bytes(data[-64:-56], "little")
    data[idx_off] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(fr.CheckpointError, match="index checksum"):
        fr.load(p, verify=False)


def test_blobs_are_aligned_and_format_is_detected_by_magic(tmp_path):
    p = tmp_path / "weights.pth"  # the name says nothing
    fr.save({"a": torch.ones(3), "b": torch.ones(5, dtype=torch.float64)}, p)
    assert fr.is_checkpoint(p)
    assert all(off % _core.BLOB_ALIGN == 0 for off, _, _ in fr.info(p)["blobs"])
    torch.save({"a": 1}, tmp_path / "plain.frk")
    assert not fr.is_checkpoint(tmp_path / "plain.frk")


def test_crc32c_hardware_matches_known_vectors():
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c(bytes(32)) == 0x8A9136AA
    data = os.urandom(1 << 20)
    assert _core.crc32c(data[1000:], _core.crc32c(data[:1000])) == _core.crc32c(data)


def test_a_writer_commits_once_and_refuses_values_after(tmp_path):
    from fastai_resume.io import encode

    tree = {"w": torch.randn(1000, 100)}
    w = encode(tree)
    size = w.commit(str(tmp_path / "a.frk"))
    assert size == os.path.getsize(tmp_path / "a.frk")
    assert torch.equal(fr.load(tmp_path / "a.frk")["w"], tree["w"])
    with pytest.raises(RuntimeError, match="already been committed"):
        w.commit(str(tmp_path / "b.frk"))
    with pytest.raises(RuntimeError, match="already been committed"):
        w.put_none()


def test_failed_commit_names_the_path_and_leaves_the_previous_file(tmp_path):
    good = tmp_path / "x.frk"
    fr.save({"v": 1}, good)
    with pytest.raises(FileNotFoundError, match="sub"):
        fr.save({"a": 1}, tmp_path / "sub" / "x.frk")
    with pytest.raises(TypeError):
        fr.save({"v": object()}, good)  # fails before anything is written
    assert fr.load(good) == {"v": 1} and os.listdir(tmp_path) == ["x.frk"]


def test_info_builds_the_tensor_table_once_not_once_per_tensor(tmp_path, monkeypatch):
    "info() (and so verify, inspect, autoresume) stays linear in the number of tensors."
    p = tmp_path / "many.frk"
    fr.save({f"t{i}": torch.full((i + 1,), float(i)) for i in range(50)}, p)
    real, calls = _core.Reader, []

    class CountingReader:  # the C type cannot be patched: wrap it
        def __init__(self, *a, **kw):
            self.r = real(*a, **kw)

        def tensors(self):
            calls.append(1)
            return self.r.tensors()

        def __getattr__(self, name):
            return getattr(self.r, name)

    monkeypatch.setattr(_core, "Reader", CountingReader)
    info = fr.info(p)
    assert len(calls) == 1
    refs = info["tree"]
    assert len(info["tensors"]) == 50 and [refs[f"t{i}"].index for i in range(50)] == list(range(50))
    assert [tuple(refs[f"t{i}"].shape) for i in range(50)] == [(i + 1,) for i in range(50)]


# ---- the binding itself --------------------------------------------------------------------------


def test_every_core_function_method_and_type_has_a_signature():
    import inspect

    checked = []
    for name, obj in vars(_core).items():
        if name.startswith("_") or not callable(obj) or obj is _core.CheckpointError:
            continue
        checked.append(name)
        inspect.signature(obj)  # raises ValueError where the docstring has no text signature
        if isinstance(obj, type):
            for mname, m in vars(obj).items():
                if not mname.startswith("_") and callable(m):
                    checked.append(f"{name}.{mname}")
                    inspect.signature(getattr(obj, mname))
    assert {
        "crc32c",
        "Writer",
        "Writer.put_int",
        "Writer.commit",
        "Mapping",
        "Reader.tree",
        "SkipToIter.before_epoch",
        "skip_plan",
    } <= set(checked)
    assert list(inspect.signature(_core.Mapping).parameters) == ["path", "copy", "verify"]
    assert str(inspect.signature(_core.Writer.commit)) == "(self, /, path, fsync=True, direct=True)"


def test_core_types_are_immutable():
    for t in (_core.Writer, _core.Mapping, _core.Reader, _core.SkipToIter):
        with pytest.raises(TypeError):
            t.extra = 1
        assert not hasattr(t, "extra")


def test_skip_actions_are_exposed_by_the_core_not_mirrored():
    s = _core.SkipToIter()
    s.arm(2, 5, 4, 10)
    assert s.before_epoch(1) == (_core.STEP_SKIP, _core.RNG_NONE, 0)
    assert s.before_epoch(2) == (_core.STEP_RESUME, _core.RNG_EPOCH_START, 5)
    s.after_epoch(2)
    assert s.before_epoch(3) == (_core.STEP_RUN, _core.RNG_NONE, 0)
    s.arm(1, 0, 4, 10)
    assert s.before_epoch(1) == (_core.STEP_RESUME, _core.RNG_SAVED, 0)
    assert len({_core.STEP_RUN, _core.STEP_SKIP, _core.STEP_RESUME}) == 3
    assert len({_core.RNG_NONE, _core.RNG_SAVED, _core.RNG_EPOCH_START}) == 3
