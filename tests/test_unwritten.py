"""A frozen base that is not a file's pages (a copy in another dtype, a `torch.load`ed state dict) is read once
for its fingerprints: later ones are the kernel's word that nothing wrote its pages since (userfaultfd's
asynchronous write protection, PAGEMAP_SCAN), and the bytes at its edges compared. Every way of writing into
a weight is seen (torch in place, NumPy, ctypes, the kernel's `readv` into it, another thread, its first and
last byte, a page dropped by `madvise`): read again, never a stale fingerprint. A real `transformers` model
written by the test, loaded with `from_pretrained` and copied to bf16; a forked child reads for itself. The
fine-tuning script with such a base, written into mid-fit: tests/test_llm.py."""

import ctypes
import os
import platform
import threading

import pytest
import torch

from fastai_resume import frozen, io, unwritten

NAME = "transformer.h.1.mlp.c_fc.weight"  # 512 KiB in bf16: tracked


def kernel_has_it() -> bool:
    "userfaultfd's asynchronous write protection: Linux 6.7 on x86-64, 6.10 on arm64; and the syscall allowed here."
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    since = {"x86_64": (6, 7), "aarch64": (6, 10)}.get(platform.machine())
    if since is None or (major, minor) < since:
        return False
    nr = {"x86_64": 323, "aarch64": 282}[platform.machine()]
    fd = ctypes.CDLL(None, use_errno=True).syscall(nr, os.O_CLOEXEC | 1)  # (a seccomp profile may forbid it)
    if fd < 0:
        return False
    os.close(fd)
    return True


pytestmark = pytest.mark.skipif(not kernel_has_it(), reason="no userfaultfd write protection here (kernel, seccomp)")


def test_tracking_is_there_on_this_kernel():
    "Where the kernel has it and allows it, it is used (the tests below are not vacuous, nor the benchmark's figure)."
    assert unwritten.available()


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    "A GPT-2 256 wide written as a hub download leaves it: most of its weights are tracked (64 KiB or more)."
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_positions=64, n_embd=256, n_layer=2, n_head=4)).save_pretrained(
        folder
    )
    return folder


def copied_base(folder) -> dict:
    "The frozen parameters of the base as a user's bf16 copy holds them (anonymous memory, not the file's)."
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16)
    model.requires_grad_(False)
    params = frozen._frozen_params(model)
    params["_model"] = model  # (kept alive with them)
    return params


def fingerprints(params):
    return frozen.fingerprints({k: p for k, p in params.items() if k != "_model"})


def plain(params):
    "Each tensor's CRC32C as read now, byte for byte, with nothing remembered."
    return {k: io.crc32c(p.detach().reshape(-1).view(torch.uint8).numpy()) for k, p in params.items() if k != "_model"}


def test_a_copied_base_is_read_once_then_proven_unwritten_by_the_kernel(base_folder, counted):
    params = copied_base(base_folder)
    total = sum(p.numel() * p.element_size() for k, p in params.items() if k != "_model" and "lm_head" not in k)
    first = fingerprints(params)
    assert counted[0] >= total  # read whole once
    assert {k: f["crc"] for k, f in first.items()} == plain(params)
    counted[0] = 0
    before = unwritten.stats()
    assert fingerprints(params) == first
    small = [k for k, p in params.items() if k != "_model" and p.numel() * p.element_size() < unwritten.MIN_BYTES]
    assert counted[0] == sum(params[k].numel() * params[k].element_size() for k in small)  # the small ones only
    big = {p.data_ptr() for k, p in params.items() if k != "_model" and k not in small}
    assert len(big) >= 8 and unwritten.stats()["proven"] - before["proven"] == len(big)  # those, proven unread


def _write(t, how):
    flat = t.detach().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if how == "torch in place":
        t.data[3, 5] += 1
    elif how == "numpy":
        flat.numpy()[n // 2] ^= 1
    elif how == "ctypes":
        ctypes.memset(t.data_ptr() + n // 3, 0x5A, 8)
    elif how == "the kernel (readv)":
        r, w = os.pipe()
        os.write(w, os.urandom(64))
        assert os.readv(r, [memoryview(flat.numpy())[n // 4 : n // 4 + 64]]) == 64
        os.close(r)
        os.close(w)
    elif how == "another thread":
        th = threading.Thread(target=lambda: flat.numpy().__setitem__(n - 5000, 7))
        th.start()
        th.join()
    elif how == "first byte":
        flat.numpy()[0] ^= 0x80
    elif how == "last byte":
        flat.numpy()[-1] ^= 0x80
    elif how == "a page dropped":  # reads back as zeros, though nothing wrote it
        page = os.sysconf("SC_PAGE_SIZE")
        at = (t.data_ptr() + n // 2) // page * page
        assert ctypes.CDLL(None).madvise(ctypes.c_void_p(at), page, 4) == 0  # MADV_DONTNEED


WAYS = ["torch in place", "numpy", "ctypes", "the kernel (readv)", "another thread", "first byte", "last byte"]


@pytest.mark.parametrize("how", WAYS + ["a page dropped"])
def test_every_way_of_writing_into_a_tracked_weight_is_seen(base_folder, counted, how):
    params = copied_base(base_folder)
    first = fingerprints(params)
    assert fingerprints(params) == first  # (proven: nothing read but the small ones)
    _write(params[NAME], how)
    counted[0] = 0
    now = fingerprints(params)
    assert counted[0] >= params[NAME].numel() * params[NAME].element_size()  # read again
    assert [k for k in first if first[k] != now[k]] == [NAME]
    assert {k: f["crc"] for k, f in now.items()} == plain(params)  # never a stale fingerprint
    assert fingerprints(params) == now  # protected again, and proven from then on


def test_negative_control_without_the_kernels_word_a_written_weight_keeps_its_stale_fingerprint(
    base_folder, monkeypatch
):
    params = copied_base(base_folder)
    first = fingerprints(params)
    monkeypatch.setattr(unwritten._T, "untouched", lambda lo, hi: True)
    _write(params[NAME], "numpy")
    assert fingerprints(params) == first  # what the scan prevents: a silent stale fingerprint


def test_a_forked_child_reads_for_itself_and_tracking_off_reads_every_time(base_folder, counted, monkeypatch):
    params = copied_base(base_folder)
    first = fingerprints(params)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the parent's protection is not the child's: it reads, and gets the same
        counted[0] = 0
        ok = fingerprints(params) == first and counted[0] > 1_000_000
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.close(w)
    monkeypatch.setenv(unwritten.ENV, "0")
    monkeypatch.setattr(unwritten, "_T", unwritten._Tracker())  # (a new process's, with the setting)
    for _ in range(2):
        counted[0] = 0
        assert fingerprints(params) == first and counted[0] > 1_000_000 and not unwritten.available()


def _crc_read(tensors):
    "A `read` for `unwritten.crcs`: each tensor's CRC32C, read now."
    return lambda names: [io.crc32c(tensors[k].reshape(-1).view(torch.uint8).numpy()) for k in names]


@pytest.mark.parametrize("lookup", ["PROCMAP_QUERY", "/proc/self/maps read"])
def test_memory_another_process_can_write_is_not_tracked_but_read_each_time(tmp_path, lookup, monkeypatch):
    """A tensor in shared memory, written by another process (through its own page tables), and a file's pages
    under a private mapping, changed by a write to the file: neither is tracked, every fingerprint reads them
    (the mappings asked of the kernel either way)."""
    import mmap

    from fastai_resume import provenance

    if lookup != "PROCMAP_QUERY":
        monkeypatch.setattr(provenance, "_query_works", [False])

    shared = torch.randn(1 << 16).share_memory_()
    (tmp_path / "f").write_bytes(os.urandom(1 << 18))
    with open(tmp_path / "f", "r+b") as f:
        m = mmap.mmap(f.fileno(), 1 << 18, flags=mmap.MAP_PRIVATE)
    mapped = torch.frombuffer(m, dtype=torch.uint8)
    tensors = {"shared": shared, "mapped": mapped}
    first = unwritten.crcs(tensors, _crc_read(tensors))
    pid = os.fork()
    if pid == 0:
        shared.numpy()[1000] += 1
        os._exit(0)
    os.waitpid(pid, 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY)
    os.pwrite(fd, b"\xff" * 64, 5000)  # the file itself, not the mapping
    os.close(fd)
    before = unwritten.stats()["reads"]
    now = unwritten.crcs(tensors, _crc_read(tensors))
    assert unwritten.stats()["reads"] - before == 2  # both read
    assert now == {k: _crc_read(tensors)([k])[0] for k in tensors} and now["shared"] != first["shared"]
    assert now["mapped"] != first["mapped"]
    del mapped, tensors
    m.close()


def test_a_file_mapped_where_a_tracked_tensor_was_is_read_not_taken_for_it(tmp_path):
    """A tracked tensor's memory unmapped and a file mapped at the same addresses (a freed copy, then a base loaded
    where it was): once `provenance` watches the file's pages (protected, as the tensor's were), what `unwritten`
    knew of those addresses is not the file's bytes: protecting them forgets it, and the bytes are read."""
    from fastai_resume import pages, provenance

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    n, rw, private, anonymous, fixed = 1 << 18, 0x1 | 0x2, 0x02, 0x20, 0x10
    addr = libc.mmap(None, n, rw, private | anonymous, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    ctypes.memmove(addr, os.urandom(n), n)
    t = torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)
    first = unwritten.crcs({"w": t}, _crc_read({"w": t}))
    before = unwritten.stats()
    assert unwritten.crcs({"w": t}, _crc_read({"w": t})) == first  # tracked: proven, not read
    assert unwritten.stats()["proven"] == before["proven"] + 1
    (tmp_path / "f").write_bytes(os.urandom(n))
    fd = os.open(tmp_path / "f", os.O_RDWR)
    try:
        assert libc.mmap(addr, n, rw, private | fixed, fd, 0) == addr  # the file, where the tensor's memory was
        assert provenance.keys({"w": t}) and pages.file_watch(addr, n) is not None  # its pages watched
        reads = unwritten.stats()["reads"]
        now = unwritten.crcs({"w": t}, _crc_read({"w": t}))
        assert now == {"w": io.crc32c((tmp_path / "f").read_bytes())} != first
        assert unwritten.stats()["reads"] == reads + 1
    finally:
        del t
        os.close(fd)
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))
