"""A frozen base loaded by `from_pretrained` (its weights the pages of the mapped safetensors file) is read
once for its fingerprints: later saves, and a new process on the same machine, take its CRC32Cs from what
was read, as long as the kernel says every page is still the file's and the file is the same version.
A write into a weight (through `.data`, through NumPy), a file rewritten in place, a corrupt remembered
file: read again, never a stale fingerprint. Real files, real `transformers` loads, a real second process;
both ways of asking the kernel (its ioctls, the text and entries of /proc/self)."""

import contextlib
import json
import mmap
import os
import struct
import subprocess
import sys
import time

import pytest
import torch

from fastai_resume import frozen, pages, provenance, unwritten

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's page table")
HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.sysconf("SC_PAGE_SIZE")


def write_base(folder, seed=0):
    "A small GPT-2 written as a hub download leaves it; returned once its file is settled (older than 2 s)."
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=4000, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    time.sleep(provenance._SETTLED_NS / 1e9 + 0.1)
    return os.path.join(folder, "model.safetensors")


def frozen_params(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.requires_grad_(False)
    return model, frozen._frozen_params(model)


FALLBACK = "maps and pagemap read"


@pytest.fixture(params=["ioctls", FALLBACK])
def lookup(request, monkeypatch, tmp_path):
    """Each test both ways the kernel is asked (Linux 6.11's PROCMAP_QUERY and 6.7's PAGEMAP_SCAN; the text of
    /proc/self/maps and the entries of /proc/self/pagemap, read), with a folder of remembered CRCs of its own;
    the ioctls' way must stay theirs (a wrong layout would fall back silently)."""
    monkeypatch.setenv(provenance.ENV, str(tmp_path / "remembered"))
    flags = [provenance._query_works, provenance._scan_works]
    if request.param == FALLBACK:
        monkeypatch.setattr(provenance, "_query_works", [False])
        monkeypatch.setattr(provenance, "_scan_works", [False])
    else:
        with mapped(tmp_path / "probe.bin", 4) as (t, _):
            provenance.keys({"probe": t})
        if not all(f[0] for f in flags):
            pytest.skip("a kernel without PROCMAP_QUERY (6.11) or PAGEMAP_SCAN (6.7)")
    provenance.forget()
    yield request.param
    provenance.forget()
    if request.param != FALLBACK:
        assert all(f[0] for f in flags)


@contextlib.contextmanager
def mapped(path, pages):
    "A file of `pages` random pages mapped privately, and a uint8 tensor over all of it."
    path.write_bytes(os.urandom(pages * PAGE))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    try:
        yield t, m
    finally:
        del t
        m.close()


def unique_bytes(params):
    return sum({p.data_ptr(): p.numel() * p.element_size() for p in params.values()}.values())


PROBE = """
import json, sys
sys.path[:0] = [{root!r}]
from transformers import AutoModelForCausalLM
from fastai_resume import frozen, io, provenance
if {fallback!r}:
    provenance._query_works[0] = provenance._scan_works[0] = False
read = [0]
real = io.crc32c_many
io.crc32c_many = lambda b, t: (read.__setitem__(0, read[0] + sum(x.nbytes for x in b)), real(b, t))[1]
model = AutoModelForCausalLM.from_pretrained({folder!r})
model.requires_grad_(False)
fps = frozen.fingerprints(frozen._frozen_params(model))
print(json.dumps([read[0], fps]))
"""


def new_process(folder, lookup="ioctls"):
    "The frozen fingerprints of the base as a new process takes them (the kernel asked `lookup`'s way), and the bytes read."
    code = PROBE.format(root=os.path.dirname(HERE), folder=str(folder), fallback=lookup == FALLBACK)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-3000:]
    read, fps = json.loads(p.stdout.strip().splitlines()[-1])
    return read, fps


def test_a_mapped_base_is_read_once_then_known_in_this_process_and_in_a_new_one(tmp_path, counted, lookup):
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    assert provenance.keys(params).keys() == params.keys()  # every weight: the file's pages
    first = frozen.fingerprints(params)
    assert counted[0] == unique_bytes(params)  # read once
    copies = frozen.fingerprints({k: p.clone() for k, p in params.items()})  # anonymous memory: read
    assert copies == first
    counted[0] = 0
    assert frozen.fingerprints(params) == first and counted[0] == 0  # the next save's: nothing read
    provenance.forget()  # a new process, on this machine: from the folder
    assert frozen.fingerprints(params) == first and counted[0] == 0
    read, fps = new_process(tmp_path / "base", lookup)
    assert read == 0 and fps == first


@pytest.mark.parametrize("how", [".data", "numpy"])
def test_a_write_into_a_mapped_weight_is_read_again_and_its_fingerprint_changes(tmp_path, counted, lookup, how):
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    name = "transformer.h.1.mlp.c_fc.weight"
    if how == ".data":
        params[name].data[3, 5] += 1
    else:
        params[name].detach().numpy()[3, 5] += 1
    counted[0] = 0
    now = frozen.fingerprints(params)
    assert name not in provenance.keys(params)
    assert 0 < counted[0] < unique_bytes(params) / 2  # that weight (and any sharing its edge pages), not the rest
    assert [k for k in first if first[k] != now[k]] == [name]
    provenance.forget()
    assert frozen.fingerprints(params) == now  # never the file's CRC for the written weight


def test_the_next_saves_fingerprints_of_the_same_views_take_one_look_at_the_pages_and_see_any_write(
    tmp_path, counted, lookup, monkeypatch
):
    """A save at every step fingerprints the same views of its base each time: the next call proves every
    region still its file's with one scan of the pages written since the last `keys` protected them (where
    userfaultfd is allowed; else one `keys`: one scan of the file's pages), the tied head included, reads
    nothing and asks no per-tensor CRC; a weight written since, a view swapped, a region forgotten each make
    it fingerprint again, never a stale answer."""
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    assert "lm_head.weight" in params  # (tied to the embedding: one region under two names)
    first = frozen.fingerprints(params)
    calls = {"keys": 0, "crcs": 0}
    for name in calls:
        real = getattr(provenance, name)
        monkeypatch.setattr(
            provenance, name, lambda *a, _r=real, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _r(*a)
        )
    counted[0] = 0
    watched = lookup != FALLBACK and unwritten.available()
    assert frozen.fingerprints(params) == first and calls == {"keys": 0 if watched else 1, "crcs": 0}
    assert counted[0] == 0
    name = "transformer.h.0.attn.c_attn.weight"
    params[name].data[0, 0] += 1
    now = frozen.fingerprints(params)
    assert [k for k in first if first[k] != now[k]] == [name] and calls["crcs"] == 1
    params[name] = params[name].clone()  # another view of the (written) weight: fingerprinted anew
    assert frozen.fingerprints(params) == now
    provenance.forget()
    counted[0] = 0
    assert frozen.fingerprints(params) == now and counted[0] > 0  # nothing remembered: read again


def test_negative_control_without_the_page_check_a_written_weight_keeps_its_stale_fingerprint(
    tmp_path, lookup, monkeypatch
):
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    monkeypatch.setattr(provenance, "_copied", lambda fd, first, end: [])
    monkeypatch.setattr(pages, "file_written", lambda lo, hi: [])  # (and the watched pages' scan: the test below)
    params["transformer.h.1.mlp.c_fc.weight"].data[3, 5] += 1
    assert frozen.fingerprints(params) == first  # what the page check prevents: a silent stale fingerprint


def test_negative_control_without_the_scan_of_watched_pages_a_written_weight_keeps_its_stale_fingerprint(
    tmp_path, monkeypatch
):
    """The next save's proof where userfaultfd is allowed is the scan of the written pages of the file pages
    `keys` protected: with its answer forced to 'none written', a weight written keeps its stale fingerprint (the
    scan is what sees the write: the test above, with it, sees it)."""
    monkeypatch.setenv(provenance.ENV, str(tmp_path / "remembered"))
    provenance.forget()
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    if not pages._T.files:
        pytest.skip("userfaultfd's write protection is not allowed here")
    monkeypatch.setattr(pages, "file_written", lambda lo, hi: [])
    params["transformer.h.1.mlp.c_fc.weight"].data[3, 5] += 1
    assert frozen.fingerprints(params) == first


def test_a_mapped_base_file_rewritten_under_its_live_mapping_is_read_again(tmp_path, counted, lookup):
    """The file under a private mapping rewritten in place (the pages nothing in this process wrote show the new
    bytes): no page was written here, but the file's version moved, so the next fingerprints read it again."""
    path = write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    assert frozen.fingerprints(params) == first
    other = write_base(tmp_path / "other", seed=1)
    data = open(other, "rb").read()
    with open(path, "r+b") as f:  # the same inode and size, other weights, under the live mapping
        f.write(data)
    counted[0] = 0
    now = frozen.fingerprints(params)
    assert counted[0] > 0 and now != first
    assert now == frozen.fingerprints({k: p.clone() for k, p in params.items()})


def test_a_base_file_rewritten_in_place_is_read_again_and_a_young_one_is_not_remembered(
    tmp_path, counted, lookup, monkeypatch
):
    path = write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    del model, params
    other = write_base(tmp_path / "other", seed=1)
    monkeypatch.setattr(provenance, "_SETTLED_NS", 3600 * 10**9)  # (this process: however long the rest takes)
    data = open(other, "rb").read()
    assert len(data) == os.path.getsize(path)
    with open(path, "r+b") as f:  # the same file (inode), the same size, other weights
        f.write(data)
    model, params = frozen_params(tmp_path / "base")
    counted[0] = 0
    now = frozen.fingerprints(params)
    assert counted[0] == unique_bytes(params) and now != first
    assert now == frozen.fingerprints({k: p.clone() for k, p in params.items()})
    versions = os.listdir(tmp_path / "remembered")
    assert len(versions) == 1  # the first version's; not the rewritten one's (changed < 2 s ago)
    read, fps = new_process(tmp_path / "base", lookup)
    assert read == unique_bytes(params) and fps == now


def test_a_corrupt_remembered_file_is_not_used(tmp_path, counted, lookup):
    write_base(tmp_path / "base")
    model, params = frozen_params(tmp_path / "base")
    first = frozen.fingerprints(params)
    (remembered,) = (tmp_path / "remembered").iterdir()
    data = bytearray(remembered.read_bytes())
    at = data.find(struct.pack("<Q", first["transformer.h.0.mlp.c_fc.weight"]["crc"]))
    assert at > 0
    data[at] ^= 1  # one remembered CRC wrong
    remembered.write_bytes(bytes(data))
    provenance.forget()
    counted[0] = 0
    assert frozen.fingerprints(params) == first and counted[0] == unique_bytes(params)


def test_the_pages_written_are_found_among_hundreds_of_runs_to_the_byte(tmp_path, lookup):
    "Every third page of 2,000 written (more runs than one PAGEMAP_SCAN returns): each tensor's answer, edges too."
    with mapped(tmp_path / "pages.bin", 2000) as (t, m):
        written = set(range(0, 1800, 3))
        for p in written:
            m[p * PAGE] = (m[p * PAGE] + 1) % 256  # a copy of that page
        spans = [(1, 3), (1, 3.0001), (2.9999, 3), (3.0001, 3.9999), (1799, 1801), (1800, 2000), (4, 6), (1, 1800)]
        spans += [(a, a + 2) for a in range(0, 1800, 7)]
        tensors = {f"{a}-{b}": t[int(a * PAGE) : int(b * PAGE)] for a, b in spans}
        got = provenance.keys(tensors)
        for a, b in spans:
            pages = set(range(int(a * PAGE) // PAGE, (int(b * PAGE) - 1) // PAGE + 1))
            assert (f"{a}-{b}" in got) == (not pages & written), (a, b)
        del tensors
