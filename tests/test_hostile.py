"""Hostile and damaged checkpoint files through `fastai_resume.load`, each loaded in a subprocess
so that a crash (a segfault, an abort) fails the test instead of the test run. (About 1,000 lines:
each hostile file is built by hand here, from the layout, next to the check that must catch it.)

* truncation at every byte offset of a real checkpoint, and 10,000 random bit flips over every
  checksum-covered byte, all raise CheckpointError (one subprocess each, looping);
* hand-built hostile files with *valid* checksums (the index and footer are rebuilt and resealed
  here, from the layout named in csrc/layout.h) are rejected by the structural checks, each with the
  message of the check that caught it; near-miss controls load;
* pickle payloads (a torch.save file, pickle bytes inside str/bytes values, pickle behind our
  magic) are never unpickled: a marker file the payload would create never appears, while the
  same payload through pickle / torch.load does create it (the controls);
* a save that hits RLIMIT_FSIZE over a good checkpoint raises OSError(EFBIG) naming the path,
  and leaves the previous checkpoint bitwise intact and no temporary file.
"""

import errno
import glob
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import fastai_resume as fr
from fastai_resume import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- a canonical, comparable description of a loaded value tree (parent and child) -----------

CANON_SRC = r"""
def canon(v):
    import numpy as np, torch
    if v is None or isinstance(v, bool):
        return ["const", repr(v)]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v.hex()]
    if isinstance(v, str):
        return ["str", v]
    if isinstance(v, bytes):
        return ["bytes", v.hex()]
    if isinstance(v, torch.Tensor):
        data = "big" if v.numel() > 1 << 20 else (
            v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
            if v.numel() else "")
        return ["torch", str(v.dtype), list(v.shape), list(v.stride()), v.storage_offset(), data]
    if isinstance(v, np.ndarray):
        data = "big" if v.size > 1 << 20 else v.tobytes().hex()
        return ["numpy", str(v.dtype), list(v.shape), data]
    if isinstance(v, dict):
        return ["dict", [[canon(k), canon(x)] for k, x in v.items()]]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [canon(x) for x in v]]
    return ["other", type(v).__name__]
"""
_ns: dict = {}
exec(CANON_SRC, _ns)  # the same canon() here as in the children
canon = _ns["canon"]

CHILD_PRELUDE = (
    r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import fastai_resume as fr
def emit(obj):
    print("RESULT " + json.dumps(obj), flush=True)
"""
    + CANON_SRC
)


class Child:
    """`code` running in a fresh interpreter, started now (the children of this module run side by
    side: each spends most of its time importing torch and fastai); `result()` waits for it."""

    def __init__(self, name: str, code: str, *args, workdir):
        env = dict(
            os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONDONTWRITEBYTECODE="1"
        )
        self.out_path, self.err_path = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.p = subprocess.Popen(
                [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *map(str, args)],
                stdout=out,
                stderr=err,
                env=env,
                cwd=ROOT,
            )

    def result(self, timeout=300):
        """(returncode, the RESULT object or None, the tail of its output, its whole stdout)."""
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        stdout, stderr = self.out_path.read_text(), self.err_path.read_text()
        result = None
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        return rc, result, stdout[-3000:] + stderr[-3000:], stdout

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def crashed(rc, out):
    return (
        f"child exited with {rc} (negative: killed by signal {-rc})\n{out}"
        if rc < 0
        else f"child exited with {rc}\n{out}"
    )


# ---- the byte layout (csrc/layout.h, docs/FORMAT.md), for building hostile files with valid checksums

MAGIC = b"\x89FRK\r\n\x1a\n"
FOOT_MAGIC = b"FRKFOOT\n"
TAG = dict(none=0, false=1, true=2, int=3, float=4, str=5, bytes=6, list=7, tuple=8, dict=9, tensor=10)


def crc(b) -> int:
    return _core.crc32c(bytes(b))


class Layout:
    """A checkpoint split into its data area (preamble + blobs + padding), blob table, tensor
    table and value-tree bytes; `seal` rebuilds the index and footer with correct CRCs."""

    @classmethod
    def parse(cls, raw: bytes) -> "Layout":
        L = cls()
        ioff, isz, fsz, icrc, L.version = struct.unpack_from("<QQQII", raw, len(raw) - 64)
        assert fsz == len(raw) and crc(raw[ioff : ioff + isz]) == icrc
        ix = raw[ioff : ioff + isz]
        (nb,) = struct.unpack_from("<Q", ix, 0)
        L.blobs = [list(struct.unpack_from("<QQII", ix, 8 + 24 * i)) for i in range(nb)]
        p = 8 + 24 * nb
        (nt,) = struct.unpack_from("<Q", ix, p)
        p += 8
        L.tensors = []
        for _ in range(nt):
            kind, dtype, ndim, resv, blob, soff = struct.unpack_from("<BBHIQQ", ix, p)
            p += 24
            sizes = list(struct.unpack_from(f"<{ndim}q", ix, p))
            strides = list(struct.unpack_from(f"<{ndim}q", ix, p + 8 * ndim))
            p += 16 * ndim
            L.tensors.append(
                dict(kind=kind, dtype=dtype, ndim=ndim, resv=resv, blob=blob, soff=soff, sizes=sizes, strides=strides)
            )
        (tl,) = struct.unpack_from("<Q", ix, p)
        L.tree = ix[p + 8 : p + 8 + tl]
        assert p + 8 + tl == isz
        L.head = raw[:ioff]
        return L

    def seal(
        self, *, nb=None, nt=None, tree_len=None, fix_blob_crcs=False, file_size_delta=0, version=None, tail=b""
    ) -> bytes:
        head = bytearray(self.head)
        if version is not None:
            struct.pack_into("<I", head, 8, version)
        ix = bytearray(struct.pack("<Q", len(self.blobs) if nb is None else nb))
        for off, ln, c, resv in self.blobs:
            if fix_blob_crcs:
                c = crc(head[off : off + ln]) if off + ln <= len(head) else 0
            ix += struct.pack("<QQII", off, ln, c, resv)
        ix += struct.pack("<Q", len(self.tensors) if nt is None else nt)
        for t in self.tensors:
            ix += struct.pack("<BBHIQQ", t["kind"], t["dtype"], t["ndim"], t["resv"], t["blob"], t["soff"])
            ix += struct.pack(f"<{len(t['sizes'])}q", *t["sizes"])
            ix += struct.pack(f"<{len(t['strides'])}q", *t["strides"])
        ix += struct.pack("<Q", len(self.tree) if tree_len is None else tree_len) + self.tree
        ioff = len(head)
        foot = bytearray(64)
        struct.pack_into(
            "<QQQII",
            foot,
            0,
            ioff,
            len(ix),
            ioff + len(ix) + 64 + file_size_delta,
            crc(ix),
            self.version if version is None else version,
        )
        struct.pack_into("<I", foot, 52, crc(foot[:52]))
        foot[56:] = FOOT_MAGIC
        return bytes(head + ix + foot) + tail

    def copy(self) -> "Layout":
        L = Layout()
        L.version, L.head, L.tree = self.version, self.head, self.tree
        L.blobs = [list(b) for b in self.blobs]
        L.tensors = [dict(t, sizes=list(t["sizes"]), strides=list(t["strides"])) for t in self.tensors]
        return L


def t_word(tag, w):
    return bytes([TAG[tag]]) + struct.pack("<Q", w)


def t_int(v):
    return bytes([TAG["int"]]) + struct.pack("<q", v)


def t_str(b: bytes, tag="str", claim=None):
    return t_word(tag, len(b) if claim is None else claim) + b


def covered_ranges(raw: bytes, info: dict):
    """Byte ranges some check covers: the preamble (magic, version, zero flags), every blob
    (CRC32C), the index (CRC32C) and the footer (magic, CRC). Padding is not covered."""
    (ioff,) = struct.unpack_from("<Q", raw, len(raw) - 64)
    return [(0, 64)] + [(o, o + n) for o, n, _ in info["blobs"] if n] + [(ioff, len(raw))]


# ---- a small real checkpoint -----------------------------------------------------------------------


def small_tree():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g)
    return {
        "model": {
            "w": w,
            "w_t": w.t(),
            "b": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "h": torch.randn(3, generator=g).half(),
        },
        "opt": {"lr": 1e-3, "step": 17, "betas": (0.9, 0.999), "state": [None, True, False]},
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "empty": torch.empty(0, 3),
        "name": "run-\u00e9\u20ac",
        "blob": b"\x00\xff\x80pickle?",
        7: [[], {}],
    }


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    p = d / "small.frk"
    tree = small_tree()
    n = fr.save(tree, p)
    raw = p.read_bytes()
    assert n == len(raw) and 700 < len(raw) < 4000
    return p, raw, canon(tree)


def test_layout_model_matches_the_writer(small_ckpt):
    "The Python layout model re-seals a real file to the very same bytes (control for the rest)."
    p, raw, want = small_ckpt
    L = Layout.parse(raw)
    assert L.seal() == raw
    assert L.seal(fix_blob_crcs=True) == raw
    assert raw[:8] == MAGIC and raw[-8:] == FOOT_MAGIC and L.version == 1
    assert canon(fr.load(p)) == want
    assert len(L.blobs) == len(fr.info(p)["blobs"]) and len(L.tensors) == len(fr.info(p)["tensors"])


# ---- truncation and bit flips ------------------------------------------------------------------------

TRUNCATE_CHILD = r"""
src, work = sys.argv[1], sys.argv[2]
raw = open(src, "rb").read()
out = {"n": len(raw), "rejected": 0, "bad": [], "msgs": {}}
for k in range(len(raw)):
    # a fresh file each time (rewriting one in place makes ext4 flush it at every close)
    if os.path.exists(work):
        os.unlink(work)
    with open(work, "xb") as f:
        f.write(raw[:k])
    try:
        fr.load(work)
        out["bad"].append([k, "loaded"])
    except fr.CheckpointError as e:
        out["rejected"] += 1
        if k in (0, 64, 127, 128, len(raw) // 2, len(raw) - 64, len(raw) - 1):
            out["msgs"][str(k)] = str(e)
    except BaseException as e:
        out["bad"].append([k, type(e).__name__ + ": " + str(e)[:200]])
os.unlink(work)
with open(work, "xb") as f:  # control: the whole file
    f.write(raw)
out["full"] = canon(fr.load(work))
emit(out)
"""


def prepare_truncation(d, small_ckpt):
    p, raw, want = small_ckpt
    work = d / "cut.frk"
    return Child("truncation", TRUNCATE_CHILD, p, work, workdir=d), dict(work=work)


def test_truncation_at_every_offset_is_rejected(small_ckpt, children):
    p, raw, want = small_ckpt
    child, ctx = children["truncation"]
    work = ctx["work"]
    rc, res, out, _ = child.result()
    assert rc == 0, crashed(rc, out)
    assert res["n"] == len(raw)
    assert res["bad"] == []
    assert res["rejected"] == len(raw)
    assert res["full"] == want  # the untruncated file loads, equal to what was saved
    msgs = res["msgs"]
    assert all(str(work) in m for m in msgs.values())  # load names the file
    assert "too short" in msgs["0"] and "too short" in msgs["127"]
    assert "no valid footer" in msgs[str(len(raw) - 1)] or "footer" in msgs[str(len(raw) - 1)]


FLIP_CHILD = r"""
src, work, plan = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
raw = open(src, "rb").read()
orig = canon(fr.load(src))
out = {"rejected": 0, "bad": [], "unverified_ok": 0, "unverified_changed": 0, "unverified_bad": []}
with open(work, "wb") as f:
    f.write(raw)
fd = os.open(work, os.O_RDWR)  # damage in place, and repair after each load

def damage(flips):
    for off, x in flips:
        os.pwrite(fd, bytes([raw[off] ^ x]), off)

def repair(flips):
    for off, _ in flips:
        os.pwrite(fd, raw[off:off + 1], off)

for flips in plan["flips"]:
    damage(flips)
    try:
        fr.load(work)
        out["bad"].append([flips, "loaded"])
    except fr.CheckpointError:
        out["rejected"] += 1
    except BaseException as e:
        out["bad"].append([flips, type(e).__name__ + ": " + str(e)[:200]])
    repair(flips)
for off, x in plan["blob_flips"]:  # control: with verify=False only the blob CRCs are skipped
    damage([[off, x]])
    try:
        v = canon(fr.load(work, verify=False))
        out["unverified_ok"] += 1
        out["unverified_changed"] += v != orig
    except BaseException as e:
        out["unverified_bad"].append([off, type(e).__name__ + ": " + str(e)[:200]])
    repair([[off, x]])
os.close(fd)
out["restored"] = open(work, "rb").read() == raw and canon(fr.load(work)) == orig
emit(out)
"""


def prepare_flips(d, small_ckpt):
    p, raw, want = small_ckpt
    info = fr.info(p)
    ranges = covered_ranges(raw, info)
    covered = [i for a, b in ranges for i in range(a, b)]
    assert len(set(covered)) == len(covered) and len(covered) < len(raw)  # the file has padding
    rnd = random.Random(1234)
    flips = [[[rnd.choice(covered), 1 << rnd.randrange(8)]] for _ in range(10_000)]
    for _ in range(1000):  # a few bytes at once, random non-zero XOR, distinct offsets
        offs = rnd.sample(covered, rnd.randint(2, 4))
        flips.append([[o, rnd.randrange(1, 256)] for o in offs])
    blob_bytes = [i for o, n, _ in info["blobs"] for i in range(o, o + n)]
    blob_flips = [[rnd.choice(blob_bytes), 1 << rnd.randrange(8)] for _ in range(200)]
    plan = d / "plan.json"
    plan.write_text(json.dumps({"flips": flips, "blob_flips": blob_flips}))
    return Child("flips", FLIP_CHILD, p, d / "flip.frk", plan, workdir=d), dict(flips=flips)


def test_random_bit_flips_in_covered_bytes_are_rejected(children):
    child, ctx = children["flips"]
    flips = ctx["flips"]
    rc, res, out, _ = child.result()
    assert rc == 0, crashed(rc, out)
    assert res["bad"] == []
    assert res["rejected"] == len(flips) == 11_000
    # controls: a blob flip passes verify=False (so the CRC, not luck, rejected it above) and
    # changes the loaded values; the restored file loads
    assert res["unverified_bad"] == [] and res["unverified_ok"] == 200
    assert res["unverified_changed"] == 200
    assert res["restored"] is True


# ---- hostile files with valid checksums ----------------------------------------------------------------


def base_layout():
    """A real checkpoint: tensor 0 = torch float32 [4, 6] (blob 0, 96 bytes), tensor 1 = torch
    int64 [5] (blob 1, 40 bytes), tensor 2 = numpy float32 [6] (blob 2, 24 bytes)."""
    import tempfile

    tree = {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "b": torch.arange(5, dtype=torch.int64),
        "n": np.arange(6, dtype=np.float32),
        "meta": {"name": "x", "epoch": 3},
    }
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "base.frk")
        fr.save(tree, p)
        raw = open(p, "rb").read()
    L = Layout.parse(raw)
    assert [b[1] for b in L.blobs] == [96, 40, 24]
    assert [(t["kind"], t["dtype"], t["sizes"]) for t in L.tensors] == [(0, 11, [4, 6]), (0, 5, [5]), (1, 11, [6])]
    return L, tree


def with_tensor(L, i, **kw):
    M = L.copy()
    t = M.tensors[i]
    t.update(kw)
    if "sizes" in kw and "ndim" not in kw:
        t["ndim"] = len(t["sizes"])
    return M


def with_tree(L, tree: bytes):
    M = L.copy()
    M.tree = tree
    return M


def nested(depth, kind="list"):
    b = b""
    for i in range(depth):
        b += t_word(kind, 1) + (t_int(i) if kind == "dict" else b"")
    return b + bytes([TAG["none"]])


def hostile_cases():
    """name -> (file bytes, expectation): ("corrupt", message part) or ("ok", canon of the value)."""
    L, tree = base_layout()
    C = {}

    def blobs(**changes):
        M = L.copy()
        for (i, field), v in changes.items():
            M.blobs[i][field] = v
        return M

    M = L.copy()
    C["control_unchanged"] = (L.seal(), ("ok", canon(tree)))
    M = L.copy()
    M.blobs[1][0] = M.blobs[0][0]
    C["blob_overlaps_blob"] = (M.seal(fix_blob_crcs=True), ("corrupt", "overlaps another"))
    M = L.copy()
    M.blobs[1][0] = M.blobs[0][0] + 64  # inside blob 0 (96 bytes)
    C["blob_overlaps_tail_of_blob"] = (M.seal(fix_blob_crcs=True), ("corrupt", "overlaps another"))
    M = L.copy()
    M.blobs[2][1] = 1 << 40
    C["blob_outside_the_data_area"] = (M.seal(), ("corrupt", "outside the data area"))
    M = L.copy()
    M.blobs[2][0] = 1 << 62
    C["blob_far_past_the_end"] = (M.seal(), ("corrupt", "outside the data area"))
    M = L.copy()
    M.blobs[0][1] = (1 << 64) - 1
    C["blob_length_overflows"] = (M.seal(), ("corrupt", "outside the data area"))
    C["blob_count_2^62"] = (L.seal(nb=1 << 62), ("corrupt", "blob count 4611686018427387904"))
    C["blob_count_2^64-1"] = (L.seal(nb=(1 << 64) - 1), ("corrupt", "does not fit in the index"))
    C["tensor_count_2^62"] = (L.seal(nt=1 << 62), ("corrupt", "tensor count 4611686018427387904"))
    C["tensor_count_1000"] = (L.seal(nt=1000), ("corrupt", "tensor count 1000"))

    C["tensor_shape_needs_more_than_blob"] = (
        with_tensor(L, 0, sizes=[4, 7], strides=[7, 1]).seal(),
        ("corrupt", "needs 112 bytes of blob 0"),
    )
    C["tensor_stride_needs_more_than_blob"] = (
        with_tensor(L, 0, sizes=[4, 6], strides=[7, 1]).seal(),
        ("corrupt", "needs 108 bytes"),
    )
    C["tensor_offset_needs_more_than_blob"] = (
        with_tensor(L, 1, soff=1).seal(),
        ("corrupt", "needs 48 bytes of blob 1"),
    )
    C["tensor_size_2^40"] = (
        with_tensor(L, 0, sizes=[1 << 40], strides=[1]).seal(),
        ("corrupt", "needs 4398046511104 bytes"),
    )
    C["tensor_size_2^62_stride_1"] = (
        with_tensor(L, 0, sizes=[1 << 62], strides=[1]).seal(),
        ("corrupt", "impossible shape"),
    )
    C["tensor_shape_product_overflow"] = (
        with_tensor(L, 0, sizes=[1 << 32, 1 << 32, 4], strides=[0, 0, 0]).seal(),
        ("corrupt", "impossible shape"),
    )
    C["tensor_storage_offset_2^63"] = (
        with_tensor(L, 0, soff=1 << 63).seal(),
        ("corrupt", "impossible shape or stride"),
    )
    C["tensor_negative_stride"] = (
        with_tensor(L, 0, sizes=[4, 6], strides=[-6, 1], soff=18).seal(),
        ("corrupt", "impossible shape or stride"),
    )
    C["tensor_negative_size"] = (
        with_tensor(L, 0, sizes=[-4, 6], strides=[6, 1]).seal(),
        ("corrupt", "impossible shape"),
    )
    C["tensor_bad_dtype_99"] = (with_tensor(L, 0, dtype=99).seal(), ("corrupt", "unknown dtype code 99"))
    C["tensor_bad_kind_7"] = (with_tensor(L, 0, kind=7).seal(), ("corrupt", "unknown kind 7"))
    C["tensor_ndim_33"] = (with_tensor(L, 0, sizes=[1] * 33, strides=[1] * 33).seal(), ("corrupt", "33 dimensions"))
    C["tensor_ndim_65535_claimed"] = (with_tensor(L, 0, ndim=65535).seal(), ("corrupt", "65535 dimensions"))
    C["tensor_blob_out_of_range"] = (with_tensor(L, 0, blob=3).seal(), ("corrupt", "refers to blob 3 of 3"))
    C["tensor_reserved_bytes"] = (with_tensor(L, 1, resv=1).seal(), ("corrupt", "reserved bytes"))
    C["numpy_kind_with_bfloat16"] = (
        with_tensor(L, 2, dtype=10, sizes=[12], strides=[1]).seal(),
        ("corrupt", "not a NumPy dtype"),
    )
    # a near miss: a strided view that exactly fits
    C["control_tensor_view_fits"] = (
        with_tensor(L, 0, sizes=[2, 3], strides=[12, 2], soff=1).seal(),
        ("ok_tensor", ["w", [2, 3], [12, 2], [[1.0, 3.0, 5.0], [13.0, 15.0, 17.0]]]),
    )

    C["tree_nesting_65"] = (with_tree(L, nested(65)).seal(), ("corrupt", "nested deeper than 64 levels"))
    C["tree_nesting_65_dicts"] = (with_tree(L, nested(65, "dict")).seal(), ("corrupt", "nested deeper"))
    C["tree_nesting_100000"] = (with_tree(L, nested(100_000)).seal(), ("corrupt", "nested deeper"))
    deep = None
    for _ in range(64):
        deep = [deep]
    C["control_tree_nesting_64"] = (with_tree(L, nested(64)).seal(), ("ok", canon(deep)))
    C["str_claims_2^62_bytes"] = (
        with_tree(L, t_str(b"abc", claim=1 << 62)).seal(),
        ("corrupt", "claims 4611686018427387904 bytes, only 3 remain"),
    )
    C["bytes_claims_4_of_3"] = (
        with_tree(L, t_str(b"abc", "bytes", claim=4)).seal(),
        ("corrupt", "claims 4 bytes, only 3 remain"),
    )
    C["str_utf8_surrogate"] = (with_tree(L, t_str(b"\xed\xa0\x80")).seal(), ("corrupt", "not valid UTF-8"))
    C["str_utf8_overlong"] = (with_tree(L, t_str(b"\xc0\xaf")).seal(), ("corrupt", "not valid UTF-8"))
    C["str_utf8_above_10ffff"] = (with_tree(L, t_str(b"\xf4\x90\x80\x80")).seal(), ("corrupt", "not valid UTF-8"))
    C["control_bytes_not_utf8"] = (
        with_tree(L, t_str(b"\xc0\xaf\xed\xa0\x80", "bytes")).seal(),
        ("ok", canon(b"\xc0\xaf\xed\xa0\x80")),
    )
    C["control_str_max_code_point"] = (with_tree(L, t_str("\U0010ffff".encode())).seal(), ("ok", canon("\U0010ffff")))
    C["list_claims_2^40_items"] = (
        with_tree(L, t_word("list", 1 << 40) + b"\x00" * 4).seal(),
        ("corrupt", "claims 1099511627776 items, only 4 bytes remain"),
    )
    C["dict_claims_2^63_pairs"] = (
        with_tree(L, t_word("dict", 1 << 63) + b"\x00" * 16).seal(),
        ("corrupt", "claims 9223372036854775808 items"),
    )
    C["dict_key_none"] = (
        with_tree(L, t_word("dict", 1) + b"\x00" + t_int(1)).seal(),
        ("corrupt", "is tag 0, not str or int"),
    )
    C["dict_key_float"] = (
        with_tree(L, t_word("dict", 1) + t_word("float", 0) + b"\x00").seal(),
        ("corrupt", "is tag 4, not str or int"),
    )
    C["dict_key_tensor"] = (
        with_tree(L, t_word("dict", 1) + t_word("tensor", 0) + b"\x00").seal(),
        ("corrupt", "is tag 10, not str or int"),
    )
    C["dict_repeated_key"] = (
        with_tree(L, t_word("dict", 2) + t_str(b"a") + t_int(1) + t_str(b"a") + t_int(2)).seal(),
        ("corrupt", "repeats a key"),
    )
    C["tensor_reference_3_of_3"] = (
        with_tree(L, t_word("tensor", 3)).seal(),
        ("corrupt", "tensor reference 3 at byte 0, but the table holds 3"),
    )
    C["tensor_reference_2^64-1"] = (
        with_tree(L, t_word("tensor", (1 << 64) - 1)).seal(),
        ("corrupt", "tensor reference"),
    )
    C["unknown_tag_11"] = (with_tree(L, b"\x0b").seal(), ("corrupt", "unknown value tag 11"))
    C["stray_bytes_after_tree"] = (with_tree(L, L.tree + b"\x00").seal(), ("corrupt", "1 stray bytes"))
    C["tree_length_word_short"] = (L.seal(tree_len=len(L.tree) - 1), ("corrupt", "value tree claims"))
    C["footer_file_size_plus_1"] = (L.seal(file_size_delta=1), ("corrupt", "footer says"))
    C["footer_file_size_minus_1"] = (L.seal(file_size_delta=-1), ("corrupt", "footer says"))
    C["bytes_appended"] = (L.seal(tail=b"\x00" * 100), ("corrupt", "no valid footer"))
    C["version_2"] = (L.seal(version=2), ("corrupt", "format version 2"))
    C["version_0"] = (L.seal(version=0), ("corrupt", "format version 0"))
    # Shapes that fit their blob but that torch / NumPy cannot build (they count elements, bytes
    # and byte strides in int64): load() must still raise CheckpointError, never ValueError.
    C["torch_broadcast_numel_over_int64"] = (
        with_tensor(L, 0, sizes=[1 << 62, 3], strides=[0, 0]).seal(),
        ("corrupt", "impossible shape"),
    )
    C["numpy_broadcast_bytes_over_int64"] = (
        with_tensor(L, 2, sizes=[1 << 31, 1 << 31], strides=[0, 0]).seal(),
        ("corrupt", "impossible"),
    )
    C["numpy_empty_with_huge_dims"] = (
        with_tensor(L, 2, sizes=[0, 1 << 62, 1 << 62], strides=[0, 0, 0]).seal(),
        ("corrupt", "impossible"),
    )
    C["numpy_size1_dim_byte_stride_over_int64"] = (
        with_tensor(L, 2, sizes=[1, 6], strides=[1 << 62, 1]).seal(),
        ("corrupt", "impossible"),
    )
    # What a load materialises stays within the file: no tensor holds more bytes than its blob
    # (a 2^27-element stride-0 tensor in a small file made fit() allocate until the process died).
    C["stride_0_tensor_of_2^27_elements"] = (
        with_tensor(L, 0, sizes=[1 << 27], strides=[0]).seal(),
        ("corrupt", "tensor 0 holds 536870912 bytes of elements but its blob 0 stores 96"),
    )
    C["broadcast_2^60_elements"] = (
        with_tensor(L, 0, sizes=[1 << 30, 1 << 30], strides=[0, 0]).seal(),
        ("corrupt", "may not be larger than its stored bytes"),
    )
    C["control_overlapping_rows_that_fit"] = (  # overlapping, but no more bytes than the blob: loads
        with_tensor(L, 0, sizes=[4, 6], strides=[0, 1]).seal(),
        ("ok_tensor", ["w", [4, 6], [0, 1], [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 4]),
    )
    C["control_empty_with_huge_stride"] = (
        with_tensor(L, 2, sizes=[0, 6], strides=[(1 << 63) - 1, 1]).seal(),
        ("ok_tensor", ["n", [0, 6], None, []]),
    )
    return C


HOSTILE_CHILD = r"""
cases = json.loads(open(sys.argv[1]).read())
for name, path in cases:
    print("CASE " + name, flush=True)  # a crash leaves this as the last line
    try:
        v = fr.load(path)
        if name == "control_tensor_view_fits":
            t = v["w"]
            r = ["ok_tensor", ["w", list(t.shape), list(t.stride()), t.tolist()]]
        elif name == "control_overlapping_rows_that_fit":
            t = v["w"]
            r = ["ok_tensor", ["w", list(t.shape), list(t.stride()), t.tolist()]]
        elif name == "control_empty_with_huge_stride":
            t = v["n"]
            r = ["ok_tensor", ["n", list(t.shape), None, t.tolist()]]
        else:
            r = ["ok", canon(v)]
    except fr.CheckpointError as e:
        r = ["corrupt", str(e)]
    except BaseException as e:
        r = ["other", type(e).__name__ + ": " + str(e)[:300]]
    print("R " + json.dumps([name, r]), flush=True)
emit("done")
"""

_CASES = hostile_cases()


def prepare_hostile(d):
    listing = []
    for name, (data, _) in _CASES.items():
        p = d / f"{name}.frk"
        p.write_bytes(data)
        listing.append([name, str(p)])
    (d / "cases.json").write_text(json.dumps(listing))
    return Child("hostile", HOSTILE_CHILD, d / "cases.json", workdir=d), dict(listing=listing)


@pytest.fixture(scope="module")
def hostile_results(children):
    child, ctx = children["hostile"]
    listing = ctx["listing"]
    rc, res, out, stdout = child.result()
    results = {}
    for line in stdout.splitlines():
        if line.startswith("R "):
            name, r = json.loads(line[2:])
            results[name] = r
    return rc, res, out, results, {name: p for name, p in listing}


@pytest.mark.parametrize("name", list(_CASES))
def test_hostile_file(name, hostile_results):
    rc, res, out, results, paths = hostile_results
    data, (want, detail) = _CASES[name]
    assert name in results, f"case {name} did not run: " + crashed(rc, out)
    got, value = results[name]
    if want == "corrupt":
        assert got == "corrupt", f"{name}: wanted CheckpointError, got {got}: {value}"
        assert detail in value, f"{name}: message {value!r} lacks {detail!r}"
        assert paths[name] in value  # the message names the file
    else:
        assert got == want, f"{name}: wanted a successful load, got {got}: {value}"
        assert value == detail


def test_hostile_batch_exited_cleanly(hostile_results):
    rc, res, out, results, paths = hostile_results
    assert rc == 0, crashed(rc, out)
    assert res == "done" and set(results) == set(_CASES)


# ---- pickle payloads are never unpickled -------------------------------------------------------------


class _Evil:
    "Unpickling this calls open(marker, 'w'): the marker file appears."

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


PICKLE_CHILD = r"""
import pickle
marker, listing = sys.argv[1], json.loads(open(sys.argv[2]).read())
out = {}
for name, path in listing:
    try:
        v = fr.load(path)
        r = ["ok", canon(v)]
    except fr.CheckpointError as e:
        r = ["CheckpointError", str(e)]
    except BaseException as e:
        r = [type(e).__name__, str(e)[:300]]
    try:
        fr.info(path)
        r.append("info ok")
    except fr.CheckpointError:
        r.append("info CheckpointError")
    except BaseException as e:
        r.append("info " + type(e).__name__)
    r.append(fr.is_checkpoint(path))
    r.append(os.path.exists(marker))
    out[name] = r
# controls, after every fr.load above: the payloads are live
payload = open(dict(listing)["pure_pickle"], "rb").read()
pickle.loads(payload)
out["control_pickle_loads_creates_marker"] = os.path.exists(marker)
os.remove(marker) if os.path.exists(marker) else None
import torch
torch.load(dict(listing)["torch_save"], weights_only=False)
out["control_torch_load_creates_marker"] = os.path.exists(marker)
emit(out)
"""


def pickle_files(tmp_path):
    """Files that carry a pickle payload which, unpickled, creates `marker`: (marker, {name: path},
    the tree of the one valid checkpoint among them, whose str and bytes values are pickles)."""
    marker = str(tmp_path / "PWNED")
    evil = _Evil(marker)
    p4 = pickle.dumps((evil, b"x" * 300), protocol=4)
    p0 = pickle.dumps(evil, protocol=0)
    assert b"open" in p4 and p0.isascii() and not os.path.exists(marker)
    files = {}

    def put(name, data):
        (tmp_path / name).write_bytes(data)
        files[name] = str(tmp_path / name)

    put("pure_pickle", p4)
    put("short_pickle", pickle.dumps(evil, protocol=4))  # under 128 bytes
    torch.save({"model": torch.zeros(3), "evil": evil}, tmp_path / "torch_save")
    files["torch_save"] = str(tmp_path / "torch_save")
    torch.save({"evil": evil}, tmp_path / "torch_legacy", _use_new_zipfile_serialization=False)
    files["torch_legacy"] = str(tmp_path / "torch_legacy")
    preamble = MAGIC + struct.pack("<I", 1) + bytes(52)
    put("magic_then_pickle", preamble + p4)
    put("magic_then_torch_zip", preamble + (tmp_path / "torch_save").read_bytes())
    put("magic_pickle_footer_magic", preamble + p4 + bytes(56) + FOOT_MAGIC)
    # a valid checkpoint whose bytes and str values are pickles: returned as data, never run
    tree = {"as_bytes": p4, "as_str": p0.decode("ascii"), "t": torch.arange(3)}
    fr.save(tree, tmp_path / "valid_with_pickles.frk")
    files["valid_with_pickles"] = str(tmp_path / "valid_with_pickles.frk")
    assert not os.path.exists(marker)
    return marker, files, tree


def prepare_pickle(tmp_path):
    marker, files, tree = pickle_files(tmp_path)
    listing = tmp_path / "listing.json"
    listing.write_text(json.dumps(list(files.items())))
    child = Child("pickle", PICKLE_CHILD, marker, listing, workdir=tmp_path)
    return child, dict(marker=marker, files=files, tree=tree)


def test_pickle_payloads_are_never_unpickled(children):
    child, ctx = children["pickle"]
    marker, files, tree = ctx["marker"], ctx["files"], ctx["tree"]
    rc, res, out, _ = child.result()
    assert rc == 0, crashed(rc, out)
    for name in (
        "pure_pickle",
        "short_pickle",
        "torch_save",
        "torch_legacy",
        "magic_then_pickle",
        "magic_then_torch_zip",
        "magic_pickle_footer_magic",
    ):
        got, msg, info, is_ckpt, marker_seen = res[name]
        assert got == "CheckpointError", (name, got, msg)
        assert files[name] in msg
        assert info == "info CheckpointError", name
        assert is_ckpt == name.startswith("magic"), name
        assert marker_seen is False, f"{name}: the pickle payload ran"
    assert "too short" in res["short_pickle"][1]
    assert "bad magic" in res["pure_pickle"][1] and "bad magic" in res["torch_save"][1]
    assert "footer" in res["magic_then_pickle"][1]
    assert "footer checksum" in res["magic_pickle_footer_magic"][1]
    got, value, info, is_ckpt, marker_seen = res["valid_with_pickles"]
    assert got == "ok" and value == canon(tree) and info == "info ok" and is_ckpt is True
    assert marker_seen is False
    # the negative controls: the very same payloads do run through pickle and torch.load
    assert res["control_pickle_loads_creates_marker"] is True
    assert res["control_torch_load_creates_marker"] is True and os.path.exists(marker)


# ---- a save that hits the file-size limit ---------------------------------------------------------------

FSIZE_CHILD = r"""
import errno, resource, signal
import torch
path, limit = sys.argv[1], int(sys.argv[2])
big = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 2}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us at the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    n = fr.save(big, path)
    r = ["saved", n]
except OSError as e:
    r = ["OSError", e.errno, str(e)]
except BaseException as e:
    r = [type(e).__name__, 0, str(e)]
emit(r)
"""


def prepare_fsize(d):
    tmp_path = d / "ckpt"  # a directory of its own: nothing else may appear in it
    tmp_path.mkdir()
    path = tmp_path / "ckpt.frk"
    good = {"w": torch.randn(64, generator=torch.Generator().manual_seed(1)), "step": 1}
    fr.save(good, path)
    before = path.read_bytes()
    limit = 64 * 1024
    assert len(before) < limit
    child = Child("fsize", FSIZE_CHILD, path, limit, workdir=d)
    return child, dict(tmp_path=tmp_path, path=path, good=good, before=before, limit=limit)


def test_save_hitting_the_file_size_limit_keeps_the_old_checkpoint(children):
    child, ctx = children["fsize"]
    tmp_path, path, good, before, limit = (ctx[k] for k in ("tmp_path", "path", "good", "before", "limit"))
    rc, res, out, _ = child.result()
    assert rc == 0, crashed(rc, out)
    kind, err_no, msg = res
    assert kind == "OSError", res
    assert err_no == errno.EFBIG, res
    assert str(path) in msg and os.strerror(errno.EFBIG) in msg, msg
    # the previous checkpoint is untouched, bit for bit, and still loads
    assert path.read_bytes() == before
    back = fr.load(path)
    assert back["step"] == 1 and torch.equal(back["w"].view(torch.int32), good["w"].view(torch.int32))
    assert glob.glob(str(tmp_path / ".ckpt.frk.tmp.*")) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt.frk"]
    # control: without the limit the same save succeeds and is larger than the limit
    n = fr.save({"w": torch.arange(1 << 20, dtype=torch.float32), "step": 2}, path)
    assert n > limit and fr.load(path)["step"] == 2


# ---- a path that is not a regular file ----------------------------------------------------------------

FIFO_CHILD = r"""
import signal
signal.alarm(5)  # the default action kills the child if the load blocks
try:
    fr.load(sys.argv[1])
    r = ["loaded", ""]
except fr.CheckpointError as e:
    r = ["CheckpointError", str(e)]
except BaseException as e:
    r = [type(e).__name__, str(e)]
r.append(fr.is_checkpoint(sys.argv[1]))  # must not block either
signal.alarm(0)
emit(r)
"""


def prepare_fifo(d):
    fifo = d / "ckpt.frk"
    os.mkfifo(fifo)
    return Child("fifo", FIFO_CHILD, fifo, workdir=d), dict(fifo=fifo)


def test_loading_a_fifo_fails_fast_instead_of_hanging(children, tmp_path):
    "frk_map_file must not block in open() on a FIFO that has no writer (O_NONBLOCK)."
    child, ctx = children["fifo"]
    rc, res, out, _ = child.result()
    assert rc == 0, crashed(rc, out)  # -14: SIGALRM, the load blocked
    assert res[0] == "CheckpointError" and "not a regular file" in res[1] and str(ctx["fifo"]) in res[1]
    assert res[2] is False  # is_checkpoint: a FIFO is not a checkpoint, and asking never blocks
    # control: a directory is refused the same way, at once, in this process
    with pytest.raises(fr.CheckpointError, match="not a regular file"):
        fr.load(tmp_path)
    assert fr.is_checkpoint(tmp_path) is False


def test_verify_command_skips_a_fifo_instead_of_hanging(tmp_path):
    fifo = tmp_path / "ckpt.frk"
    os.mkfifo(fifo)
    fr.save({"x": 1}, tmp_path / "good.frk")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for target in (fifo, tmp_path):  # (the timeout is the test: a FIFO opened for reading would block)
        r = subprocess.run(
            [sys.executable, "-m", "fastai_resume", "verify", str(target)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if target == fifo:  # named on the command line: not a checkpoint, a failure that says why
            assert r.returncode == 2 and "is not a regular file" in r.stderr, (r.returncode, r.stdout, r.stderr)
        else:  # met while scanning a folder: skipped
            assert r.returncode == 0 and f"SKIP {fifo}" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    assert f"OK   {tmp_path / 'good.frk'}" in r.stdout


# ---- paths the error messages must survive ---------------------------------------------------------


def test_a_non_utf8_path_in_an_error_is_escaped_not_a_unicode_error(tmp_path):
    bad_dir = tmp_path / os.fsdecode(b"no-such-\xff\xfe-dir")
    with pytest.raises(OSError) as e:
        fr.save({"x": 1}, bad_dir / "x.frk")
    assert e.value.errno == errno.ENOENT and "no-such-\\xff\\xfe-dir" in str(e.value)
    with pytest.raises(OSError, match=r"no-such-\\xff\\xfe-dir"):
        fr.load(bad_dir / "x.frk")


@pytest.mark.parametrize("pad", range(4))
def test_an_error_about_a_long_path_is_cut_between_characters(tmp_path, pad):
    "The C message buffer is cut at a character boundary (4-byte characters: 3 in 4 cuts would split one)."
    deep = tmp_path / ("x" * pad + "\U0001f600" * 60) / ("\U0001f600" * 60) / "x.frk"
    with pytest.raises(OSError) as e:
        fr.save({"x": 1}, deep)
    msg = str(e.value)
    assert e.value.errno in (errno.ENOENT, errno.ENAMETOOLONG) and msg.endswith("...")
    assert "\U0001f600" * 10 in msg and "\\x" not in msg  # whole characters, none escaped


def test_a_name_of_240_or_255_bytes_saves_and_loads(tmp_path):
    "The temporary file's name must fit NAME_MAX (255) too: a long name gets a short one."
    for n in (240, 255):
        p = tmp_path / ("c" * (n - 4) + ".frk")
        fr.save({"n": n, "t": torch.arange(3)}, p)
        back = fr.load(p)
        assert back["n"] == n and torch.equal(back["t"], torch.arange(3))
    assert sorted(len(q.name) for q in tmp_path.iterdir()) == [240, 255]  # no temporary file left


# ---- every child starts at once ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def children(small_ckpt, tmp_path_factory):
    """Prepares the inputs of every subprocess test, then starts all the children together, so
    their interpreter start-ups (torch + fastai, several seconds each) overlap."""
    prepare = {
        "truncation": lambda d: prepare_truncation(d, small_ckpt),
        "flips": lambda d: prepare_flips(d, small_ckpt),
        "hostile": prepare_hostile,
        "pickle": prepare_pickle,
        "fsize": prepare_fsize,
        "fifo": prepare_fifo,
    }
    started = {}
    try:
        for name, fn in prepare.items():
            started[name] = fn(tmp_path_factory.mktemp(name))
        yield started
    finally:
        for child, _ in started.values():
            child.stop()
