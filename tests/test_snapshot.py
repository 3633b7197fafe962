"""Background saves copy everything mutable at the batch boundary: what training changes after the
snapshot is taken never reaches the file, which holds the old values and verifies."""

import os
import signal
import sys
import threading

import numpy as np
import pytest
import torch

import fastai_resume as fr
from fastai_resume.snapshot import BackgroundCommit, SnapshotPool


def state():
    return {
        "model": {"w": torch.arange(1_000_000, dtype=torch.float32)},
        "train": {
            "cb": {"counts": np.arange(1_000_000, dtype=np.int64), "raw": bytearray(b"abcd")},
            "ints": list(range(100)),  # (a list of plain values: copied as one, not walked)
        },
    }


def mutate(tree):
    tree["model"]["w"].fill_(-1)
    tree["train"]["cb"]["counts"][:] = -1
    tree["train"]["cb"]["raw"][:] = b"zzzz"
    tree["train"]["ints"][:] = [-1] * 100


def test_a_numpy_array_changed_after_a_background_save_starts_is_saved_with_its_old_values(tmp_path):
    tree = state()
    tree["model"]["big"] = torch.zeros(64 << 20, dtype=torch.uint8)  # written before the array
    bc = BackgroundCommit(tree, tmp_path / "a.frk")
    tree["train"]["cb"]["counts"][:] = -1  # training goes on while the thread writes
    mutate(tree)
    bc.wait()
    fr.info(tmp_path / "a.frk", verify=True)  # every checksum holds
    back = fr.load(tmp_path / "a.frk")
    assert np.array_equal(back["train"]["cb"]["counts"], np.arange(1_000_000))
    assert torch.equal(back["model"]["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert back["train"]["ints"] == list(range(100))
    assert back["train"]["cb"]["raw"] == b"abcd"
    assert tree["train"]["cb"]["counts"][0] == -1  # the control: training's own array did change


def test_a_snapshot_is_independent_of_every_array_tensor_and_bytearray_of_the_tree(tmp_path):
    tree = state()
    snap = SnapshotPool().snapshot(tree)
    mutate(tree)
    fr.save(snap, tmp_path / "s.frk")
    back = fr.load(tmp_path / "s.frk")
    assert back["train"]["cb"]["counts"][-1] == 999_999
    assert back["model"]["w"][-1].item() == 999_999
    assert back["train"]["cb"]["raw"] == b"abcd"


def test_the_second_snapshot_reuses_the_first_ones_buffers_and_holds_the_new_values():
    pool = SnapshotPool()
    tree = state()
    first = pool.snapshot(tree)
    ptr, arr = first["model"]["w"].untyped_storage().data_ptr(), first["train"]["cb"]["counts"]
    mutate(tree)
    second = pool.snapshot(tree)
    assert second["model"]["w"].untyped_storage().data_ptr() == ptr
    assert second["train"]["cb"]["counts"] is arr
    assert second["model"]["w"][0].item() == -1 and second["train"]["cb"]["counts"][0] == -1


def test_tensors_sharing_a_storage_share_it_in_the_snapshot_and_in_the_file(tmp_path):
    base = torch.arange(10.0)
    snap = SnapshotPool().snapshot({"a": base, "b": base[2:5], "c": base.view(2, 5).t()})
    assert (
        snap["a"].untyped_storage().data_ptr()
        == snap["b"].untyped_storage().data_ptr()
        == snap["c"].untyped_storage().data_ptr()
        != base.untyped_storage().data_ptr()
    )
    fr.save(snap, tmp_path / "s.frk")
    back = fr.load(tmp_path / "s.frk")
    assert torch.equal(back["c"], base.view(2, 5).t())
    assert back["b"].untyped_storage().data_ptr() == back["a"].untyped_storage().data_ptr()


def test_a_conjugated_or_negated_view_keeps_its_values_in_the_snapshot(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j])
    x = torch.tensor([1.0, 2.0])
    fr.save(SnapshotPool().snapshot({"conj": z.conj(), "neg": x._neg_view()}), tmp_path / "s.frk")
    back = fr.load(tmp_path / "s.frk")
    assert torch.equal(back["conj"], torch.tensor([1 - 2j, 3 + 4j]))
    assert torch.equal(back["neg"], torch.tensor([-1.0, -2.0]))


def test_a_failed_background_write_raises_at_wait_with_the_path_and_runs_no_then(tmp_path):
    ran = []
    bc = BackgroundCommit(state(), tmp_path / "missing-dir" / "x.frk", then=lambda: ran.append(1))
    with pytest.raises(OSError, match="missing-dir"):
        bc.wait()
    assert bc.done and ran == [] and bc.then_result is None  # retention never follows a failed commit


def test_then_runs_in_the_writer_thread_once_the_file_is_committed(tmp_path):
    seen = []

    def then():
        seen.append((threading.current_thread().name, (tmp_path / "x.frk").exists()))
        return "retired"

    bc = BackgroundCommit(state(), tmp_path / "x.frk", then=then)
    bc.wait()
    assert seen == [("fastai_resume-commit", True)] and bc.then_result == "retired" and bc.then_error is None


def test_an_error_in_then_is_its_own_and_the_save_still_counts(tmp_path):
    def then():
        raise PermissionError("cannot remove the old file")

    bc = BackgroundCommit(state(), tmp_path / "x.frk", then=then)
    assert bc.wait() > 0  # the commit's bytes: the file is saved
    assert isinstance(bc.then_error, PermissionError) and bc.then_result is None
    fr.info(tmp_path / "x.frk", verify=True)


def test_an_unstorable_value_fails_when_the_save_starts_with_its_path(tmp_path):
    with pytest.raises(TypeError, match=r"\['train'\]\['cb'\]\['bad'\]"):
        BackgroundCommit({"train": {"cb": {"bad": object()}}}, tmp_path / "x.frk")
    assert not (tmp_path / "x.frk").exists()


def test_conjugated_views_resolved_one_after_another_each_keep_their_own_values(tmp_path):
    # each resolved view is a temporary storage of the same size: its address may be reused
    zs = [torch.full((1000,), complex(i, i + 1)) for i in range(20)]
    snap = SnapshotPool().snapshot([z.conj() for z in zs])
    assert [complex(s[0]) for s in snap] == [complex(i, -(i + 1)) for i in range(20)]


@pytest.mark.parametrize("now", [False, True], ids=["snapshot", "written-now"])
def test_a_background_save_writes_the_bytes_a_synchronous_save_writes_its_checksums_taken_while_copying(tmp_path, now):
    """Big storages are copied into page-aligned buffers with their CRC32C taken during the copy
    (the commit then does not read them for it) and written around the page cache: the file is
    the synchronous save's, byte for byte, through the pool's reused buffers too. A checkpoint written
    now (at most `write_now_max` bytes: from the live tensors, published by the thread) is the same
    file, and copies nothing."""
    from fastai_resume import _core
    from fastai_resume.snapshot import WRITE_NOW_MAX

    tree = state()
    tree["model"]["big"] = torch.randn(3 << 18)  # 3 MiB: page-aligned, checksummed while copied
    tree["model"]["view"] = tree["model"]["big"][1::3]  # a view sharing it
    pool = SnapshotPool()
    for i in range(2):
        tree["model"]["big"].add_(1)
        bc = BackgroundCommit(tree, tmp_path / "bg.frk", pool, write_now_max=WRITE_NOW_MAX if now else 0)
        assert bc.written_now == now
        bc.wait()
        fr.save(tree, tmp_path / "sync.frk")
        assert (tmp_path / "bg.frk").read_bytes() == (tmp_path / "sync.frk").read_bytes(), f"save {i}"
        snap_crcs = dict(pool.crcs)
        if now:
            assert snap_crcs == {} and sorted(p.name for p in tmp_path.iterdir()) == ["bg.frk", "sync.frk"]
            continue
        assert len(snap_crcs) == 2  # the two storages of at least PAGE_ALIGN_MIN bytes
        for (addr, n), crc in snap_crcs.items():
            assert addr % _core.PAGE_ALIGN == 0 and n >= _core.PAGE_ALIGN_MIN
            assert crc in {c for _, length, c in fr.info(tmp_path / "bg.frk")["blobs"] if length == n}
        big = [(o, n) for o, n, _ in fr.info(tmp_path / "bg.frk", verify=True)["blobs"] if n >= _core.PAGE_ALIGN_MIN]
        assert big and all(o % _core.PAGE_ALIGN == 0 for o, _ in big)
    back = fr.load(tmp_path / "bg.frk")
    assert torch.equal(back["model"]["big"], tree["model"]["big"])
    assert torch.equal(back["model"]["view"], tree["model"]["view"])


def test_copy_crc32c_copies_and_checksums_and_refuses_what_it_cannot_do():
    from fastai_resume import _core

    for n in (0, 5, 70_000, (16 << 20) + 12_345):  # the last one is split over two threads
        src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        assert _core.copy_crc32c(dst, src) == _core.crc32c(src) and np.array_equal(dst, src)
    buf = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _core.copy_crc32c(buf[10:60], buf[:50])
    with pytest.raises(ValueError, match="bytes"):
        _core.copy_crc32c(np.zeros(3, dtype=np.uint8), b"ab")
    with pytest.raises(TypeError):
        _core.copy_crc32c(b"read-only", b"read-only")


def test_the_split_copy_runs_on_torchs_openmp_runtime_and_copies_the_same_either_way():
    import fastai.data.all  # noqa: F401  (brings scikit-learn's own renamed libgomp in: it runs apart)

    from fastai_resume import _core, snapshot

    # this venv's torch runs on its libgomp.so.1, the one the core (linking no OpenMP runtime) calls
    assert snapshot.COPY_ON_OPENMP and snapshot._openmp_is_torchs()
    maps = open("/proc/self/maps").read()
    assert len({ln.split()[-1] for ln in maps.splitlines() if ln.endswith("/libgomp.so.1")}) == 1
    try:
        for openmp in (True, False):
            assert _core.copy_use_openmp(openmp) is openmp
            for n in ((2 << 20) - 1, 2 << 20, (2 << 20) + 1, (16 << 20) + 4099):
                src = np.random.default_rng(n).integers(0, 256, n + 3, dtype=np.uint8)[3:]  # off a line
                dst = np.zeros(n + 1, dtype=np.uint8)[1:]
                assert _core.copy_crc32c(dst, src) == _core.crc32c(src) and np.array_equal(dst, src)
    finally:
        _core.copy_use_openmp(snapshot.COPY_ON_OPENMP)


def _mapping_of(addr: int) -> dict:
    "The /proc/self/smaps fields of the mapping that holds `addr` (VmFlags as a set)."
    with open("/proc/self/smaps") as f:
        fields = None
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if fields is not None:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                fields = {} if lo <= addr < hi else None
            elif fields is not None:
                fields[head.rstrip(":")] = line.split()[1:]
    assert fields is not None, "no mapping holds the buffer"
    fields["VmFlags"] = set(fields.get("VmFlags", []))
    return fields


def test_big_snapshot_buffers_start_on_a_huge_page_and_are_offered_to_transparent_huge_pages(tmp_path):
    from fastai_resume import snapshot

    n = (48 << 20) + 4097  # not a multiple of a page
    st = snapshot._page_storage(n)
    assert st.nbytes() == n and st.data_ptr() % snapshot._HUGE == 0
    torch.empty(0, dtype=torch.uint8).set_(st).fill_(7)
    # madvised for huge pages (hg; the kernel backs them where it can: AnonHugePages) and not
    # inherited by forked processes, such as fastai's DataLoader workers (dc)
    assert {"hg", "dc"} <= _mapping_of(st.data_ptr())["VmFlags"]
    small = snapshot._page_storage(n, huge_pages=False)
    torch.empty(0, dtype=torch.uint8).set_(small).fill_(1)
    assert small.data_ptr() % 4096 == 0 and small.nbytes() == n
    flags = _mapping_of(small.data_ptr())["VmFlags"]
    assert "dc" in flags and "hg" not in flags
    pid = os.fork()  # a forked child does not see the buffer; the parent's stays as it was
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert int(torch.empty(0, dtype=torch.uint8).set_(st).sum()) == 7 * n
    # a background save from such a buffer: the file holds its bytes and verifies
    tree = {"model": {"w": torch.arange(n // 4, dtype=torch.float32)}}
    BackgroundCommit(tree, tmp_path / "h.frk").wait()
    fr.info(tmp_path / "h.frk", verify=True)
    assert torch.equal(fr.load(tmp_path / "h.frk")["model"]["w"], tree["model"]["w"])


FORKED_CHILD = """
import gc, os, sys
os.environ["OMP_NUM_THREADS"] = "1"
import torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from fastai_resume import snapshot
from fastai_resume.snapshot import SnapshotPool
pool = SnapshotPool()
snap = pool.snapshot({{"w": torch.ones(16 << 20)}})  # 64 MB: a buffer forked children do not have
junk = [snap, pool]
junk.append(junk)  # garbage only a GC pass frees
del snap, pool, junk
gc.disable()
if {control}:
    snapshot._NOT_FORKED.clear()  # the negative control: the child does not keep the buffers' objects
pid = os.fork()  # as fastai forks its DataLoader workers
if pid == 0:
    mine = [torch.full((16 << 20,), 7.0) for _ in range(4)]  # the child's own memory, mapped where it can
    gc.collect()  # the parent's garbage freed in the child
    os._exit(0 if all(int(t[::4096].sum()) == 7 * len(t[::4096]) for t in mine) else 1)
print(os.waitpid(pid, 0)[1])
"""


@pytest.mark.parametrize("control", [False, True], ids=["kept", "negative-control"])
def test_a_forked_child_that_frees_snapshot_garbage_keeps_its_own_memory(control):
    """The snapshot's buffers are not inherited by forked children (MADV_DONTFORK); their Python objects
    are. A child's GC freeing them unmapped what the child had mapped since at those addresses (a
    DataLoader worker's batch: a segmentation fault, found with AutoCheckpoint and a vision_learner's
    workers). A child keeps those objects; without that (the control) it dies by SIGSEGV."""
    import subprocess

    code = FORKED_CHILD.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), control=control)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split()[-1]) == (signal.SIGSEGV if control else 0)
