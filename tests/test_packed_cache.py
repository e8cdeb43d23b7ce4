"""Packed weights kept on disk (`outrider.models.packed_cache`): a second load maps what the first packed, and
an entry is only ever found by a load that would have packed the same tensors."""

import ctypes
import mmap
import os

import gguf
import numpy as np
import pytest
import torch

import outrider.models.linear as linear
from outrider import native
from outrider.io.gguf import GGUFFile
from outrider.models import packed_cache
from outrider.models.linear import PackedLinear
from outrider.models.weight_forms import load_linear

Q = gguf.GGMLQuantizationType
ROWS, COLS = 32, 512


def _write(path, seed: int):
    """A GGUF file with a Q6_K, a Q8_0 and a Q4_0 weight of [ROWS, COLS]."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = ROWS * COLS // 256
    q6 = rng.integers(0, 256, size=(blocks, 210), dtype=np.uint8)
    q6[:, 208:210] = np.full((blocks, 1), 0.01, dtype=np.float16).view(np.uint8)  # a finite super-scale
    writer.add_tensor("a.weight", q6.reshape(ROWS, -1), raw_dtype=Q.Q6_K)
    for name, qtype in (("b.weight", Q.Q8_0), ("c.weight", Q.Q4_0)):
        source = (rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(source, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache (under tmp_path/home: the kernels stay in $OUTRIDER_HOME) that keeps files of any size,
    and a count of the loads that packed; int8 activations where the build has them, whatever an earlier test
    left set."""
    try:
        kernels = native.load()
    except native.NativeUnavailable as e:  # no compiler: the CPU backend holds dense weights, nothing is packed
        pytest.skip(str(e))
    monkeypatch.setattr(packed_cache, "outrider_home", lambda: tmp_path / "home")
    monkeypatch.setenv("OUTRIDER_PACKED_CACHE", "1")
    packs = []
    pack = linear._pack

    def counted(*args, **kwargs):
        packs.append(args[1])
        return pack(*args, **kwargs)

    monkeypatch.setattr(linear, "_pack", counted)
    with native.activations("int8" if kernels.HAS_INT8_KERNELS else "float32"):
        yield packs


def _load(path, names, row_maps=None):
    lin = load_linear(GGUFFile(path), names, packed=True, dtype=torch.float32, device="cpu", row_maps=row_maps)
    assert isinstance(lin, PackedLinear)
    return lin


def _same(a: PackedLinear, b: PackedLinear):
    assert (a.kind, a.group, a.n_out, a.k) == (b.kind, b.group, b.n_out, b.k)
    for x, y in zip([a.codes, a.scales, a.zeros, *a.lanes], [b.codes, b.scales, b.zeros, *b.lanes], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    x = torch.randn(5, a.k, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a(x), b(x))
    ids = torch.tensor([0, 17, 31, 5])
    assert torch.equal(a.rows(ids), b.rows(ids))


def _mappings_of(path) -> list[tuple[int, int, int]] | None:
    """(start, end, resident bytes) of each mapping of the file at path in this process (Linux's /proc/self/smaps;
    None elsewhere)."""
    if not os.path.exists("/proc/self/smaps"):
        return None
    spans, mapped = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                mapped = line.rstrip().endswith(str(path))
                if mapped:
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    spans.append([start, end, 0])
            elif mapped and head and head[0] == "Rss:":
                spans[-1][2] = int(head[1]) * 1024
    return [tuple(span) for span in spans]


def _mapped_from(t: torch.Tensor, path) -> bool:
    """Whether the tensor's memory is a mapping of the file at path (True where that cannot be read)."""
    spans = _mappings_of(path)
    return spans is None or any(start <= t.data_ptr() < end for start, end, _ in spans)


def _resident_bytes(path) -> int | None:
    """Bytes of the file at path that this process has mapped in (None where that cannot be read)."""
    spans = _mappings_of(path)
    return None if spans is None else sum(rss for _, _, rss in spans)


def _populate_works() -> bool:
    """Whether this kernel knows MADV_POPULATE_READ (older ones get MADV_WILLNEED, which maps nothing in)."""
    madvise = packed_cache._madvise()
    if madvise is None:
        return False
    page = mmap.mmap(-1, mmap.PAGESIZE)
    view = ctypes.c_char.from_buffer(page)
    try:
        return madvise(ctypes.addressof(view), mmap.PAGESIZE, packed_cache._MADV_POPULATE_READ) == 0
    finally:
        del view
        page.close()


FUSED = ["a.weight", "b.weight", "c.weight"]
REVERSED = {"b.weight": lambda rows: rows.flip(0)}


def test_a_second_load_maps_what_the_first_packed(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", 1)
    first = _load(path, FUSED, REVERSED)
    assert cache == [FUSED]
    second = _load(path, FUSED, REVERSED)
    assert cache == [FUSED]  # nothing packed again: mapped from the entry's file
    (entry,) = (tmp_path / "home").glob("packed/*/*.pt")
    assert all(_mapped_from(t, entry) for t in [*second.lanes, second.codes] if t.numel())
    _same(first, second)
    monkeypatch.setenv("OUTRIDER_PACKED_CACHE", "0")
    _same(_load(path, FUSED, REVERSED), second)  # and both are what packing gives
    assert len(cache) == 2


def test_a_mapped_entry_is_in_memory_before_its_first_product(tmp_path, cache):
    """As llama.cpp maps its file with MAP_POPULATE: the first forward after a load does not fault its weights in."""
    path = _write(tmp_path / "m.gguf", 4)
    _load(path, FUSED)
    second = _load(path, FUSED)
    (entry,) = (tmp_path / "home").glob("packed/*/*.pt")
    resident = _resident_bytes(entry)
    if resident is None or not _populate_works():
        pytest.skip("no /proc/self/smaps or MADV_POPULATE_READ (Linux 5.14) here")
    held = sum(t.numel() * t.element_size() for t in [second.codes, second.scales, second.zeros, *second.lanes])
    assert resident >= held > 0


def test_an_entry_is_found_only_by_a_load_that_packs_the_same(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", 2)
    plain = _load(path, FUSED)
    reversed_b = _load(path, FUSED, REVERSED)  # other rows
    assert len(cache) == 2 and not torch.equal(plain(torch.ones(1, COLS)), reversed_b(torch.ones(1, COLS)))
    _load(path, FUSED[:2])  # other tensors
    assert len(cache) == 3
    if native.load().SIX_BIT_LANES and native.load().HAS_LANE_TILES:
        monkeypatch.setenv("OUTRIDER_SIX_BIT_LANES", "0")  # another form
        eight = _load(path, ["a.weight"])
        monkeypatch.delenv("OUTRIDER_SIX_BIT_LANES")
        six = _load(path, ["a.weight"])
        assert len(cache) == 5 and six.lanes[0].numel() * 4 == eight.lanes[0].numel() * 3
    before = len(cache)
    if native.load().HAS_INT8_KERNELS:
        with native.activations("float32"):  # the row form held too
            rows_too = _load(path, FUSED)
        assert len(cache) == before + 1 and rows_too.codes.numel() > 0
        before += 1
    folders = list((tmp_path / "home" / "packed").iterdir())
    assert len(folders) == 1
    _write(path, 3)  # the file rewritten: its old entries are not found, and go when the next is written
    os.utime(path, ns=(1, 1))
    again = _load(path, FUSED)
    assert len(cache) == before + 1
    assert [f for f in (tmp_path / "home" / "packed").iterdir()] != folders
    assert len(list((tmp_path / "home" / "packed").iterdir())) == 1
    assert not torch.equal(again(torch.ones(1, COLS)), plain(torch.ones(1, COLS)))


def test_a_torn_entry_is_packed_again(tmp_path, cache):
    path = _write(tmp_path / "m.gguf", 4)
    first = _load(path, FUSED)
    (entry,) = (tmp_path / "home" / "packed").glob("*/*.pt")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    second = _load(path, FUSED)
    assert len(cache) == 2
    _same(first, second)
    _same(first, _load(path, FUSED))  # the entry written again
    assert len(cache) == 2


def test_a_cache_that_cannot_be_written_costs_one_warning(tmp_path, cache, monkeypatch, capfd):
    monkeypatch.setattr(packed_cache, "_warned", False)
    (tmp_path / "home").write_text("a file where the folder would go")
    path = _write(tmp_path / "m.gguf", 5)
    first, second = _load(path, FUSED), _load(path, ["b.weight"])
    err = capfd.readouterr().err
    assert err.count("cannot keep packed weights") == 1 and "OUTRIDER_PACKED_CACHE=0" in err
    assert len(cache) == 2 and first.n_out == 3 * ROWS and second.n_out == ROWS


def test_small_files_are_not_kept_unless_asked_and_none_when_off(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", 6)
    monkeypatch.delenv("OUTRIDER_PACKED_CACHE")
    _load(path, FUSED)
    monkeypatch.setenv("OUTRIDER_PACKED_CACHE", "0")
    _load(path, FUSED)
    assert not (tmp_path / "home" / "packed").exists() and len(cache) == 2


def test_what_was_packed_from_a_file_that_changed_meanwhile_is_not_kept(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", 7)
    pack = linear._pack

    def touched(*args, **kwargs):
        os.utime(path, ns=(2, 2))  # the file rewritten while it is packed
        return pack(*args, **kwargs)

    monkeypatch.setattr(linear, "_pack", touched)
    _load(path, FUSED)
    assert not list((tmp_path / "home").glob("packed/*/*.pt"))


def test_entries_of_other_packing_code_and_stopped_writes_go_when_an_entry_is_written(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", 8)
    version = packed_cache._code_version()
    monkeypatch.setattr(packed_cache, "_code_version", lambda: "0ld")
    _load(path, FUSED)
    monkeypatch.setattr(packed_cache, "_code_version", lambda: version)
    (folder,) = (tmp_path / "home" / "packed").iterdir()
    stopped, recent = folder / "stopped.tmp", folder / "writing.tmp"  # temporary files of writers, stopped or not
    stopped.write_bytes(b"x"), recent.write_bytes(b"x")
    os.utime(stopped, (0, 0))
    _load(path, FUSED)  # not found: packed again
    assert len(cache) == 2
    assert [p.name.split("-")[0] for p in folder.glob("*.pt")] == [version]
    assert not stopped.exists() and recent.exists()


def test_a_failed_write_leaves_nothing_and_warns(tmp_path, cache, monkeypatch, capfd):
    monkeypatch.setattr(packed_cache, "_warned", False)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(packed_cache.torch, "save", full)
    path = _write(tmp_path / "m.gguf", 9)
    lin = _load(path, FUSED)
    assert lin.n_out == 3 * ROWS and "cannot keep packed weights" in capfd.readouterr().err
    assert [p.name for p in (tmp_path / "home").glob("packed/*/*") if p.name != "source.json"] == []
