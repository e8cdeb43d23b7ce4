"""Packed weights kept on disk, so that a model file is repacked once, not at every start.

Turning a GGUF file's blocks into the forms the kernels read (`outrider.models.linear.load_packed`: codes,
scales, the lane form) is numpy and torch work over every weight, seconds per model on a small machine, where
llama.cpp maps its file and starts. So the first load of a file saves what it made under
`$OUTRIDER_HOME/packed/`, one folder per model file, and later loads map those tensors (`torch.load(mmap=True)`):
no copy is made: the pages are the page cache's, shared between processes, as with the GGUF file itself. They are
put in place at load (`madvise(MADV_POPULATE_READ)`, as llama.cpp maps its file with MAP_POPULATE), so the first
forward does not fault the weights in 4 KiB at a time, from disk where the file is not cached.

An entry is found by everything its tensors depend on: the file's contents as the loading process opened them
(device, inode, size, modification and change times: a file replaced or rewritten at the same path is another
file), the tensors and the rows each takes (a row map is known by the rows it picks), the form asked for (lane
form or not), this build's and environment's choices of form (lane tiles, factored scales, six-bit codes, int8
activations), and the source of the code that packs, so a change there makes new entries. Writing an entry
removes the folder's entries made by other code; a new folder removes the folders of files changed or gone.
What was packed from a file that changed while it was packed is not kept.

`OUTRIDER_PACKED_CACHE=0` turns it off, `=1` keeps files of any size; by default files of MIN_FILE_BYTES or
more, so the small files tests and tools write and delete leave nothing behind. A cache that cannot be
written (a full disk, a read-only home) costs a warning, once; an entry that cannot be read is packed again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from outrider.paths import outrider_home

MIN_FILE_BYTES = 64 << 20
_warned = False


def enabled_for(path: Path) -> bool:
    setting = os.environ.get("OUTRIDER_PACKED_CACHE", "auto")
    if setting == "0":
        return False
    try:
        return setting == "1" or path.stat().st_size >= MIN_FILE_BYTES
    except OSError:
        return False


def file_identity(path: Path) -> tuple[int, ...]:
    """What tells a file's present contents from another's at the same path (as GGUFFile.identity)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.cache
def _code_version() -> str:
    """The packing code's own source: entries made by other code are not found."""
    core = Path(__file__).parents[1]
    sources = [core / "models" / "linear.py", Path(__file__), core / "io" / "gguf.py", core / "native" / "codes.py"]
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]


def _folder(path: Path, identity: tuple[int, ...]) -> Path:
    digest = hashlib.sha256(repr((os.path.realpath(path), identity)).encode()).hexdigest()[:20]
    return outrider_home() / "packed" / f"{Path(path).stem[:60]}-{digest}"


def entry_name(parts: list[Any]) -> str:
    """An entry's file name: the packing code's version, then a digest of what it depends on (strings, numbers
    and tensors, by their values)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(part.contiguous().numpy().tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return f"{_code_version()}-{h.hexdigest()[:32]}.pt"


def load(path: Path, identity: tuple[int, ...], parts: list[Any]) -> dict[str, Any] | None:
    """The entry for these parts of the model file, its tensors mapped, or None."""
    try:
        entry = _folder(path, identity) / entry_name(parts)
        if not entry.is_file():
            return None
    except OSError:
        return None
    try:
        held = torch.load(entry, mmap=True, weights_only=True)
    except Exception:  # a torn or foreign file: pack again, and let the new entry replace it
        with contextlib.suppress(OSError):
            entry.unlink()
        return None
    prefault(held)
    return held


_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14 and later


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def prefault(held: dict[str, Any]) -> None:
    """Map the pages of `held`'s tensors now: one call per storage, where the first forward would otherwise fault
    each page in. An older kernel without MADV_POPULATE_READ gets MADV_WILLNEED (the file read ahead into memory)."""
    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    for tensor in _tensors(held.values()):  # each owns its storage (`_own`, when the entry was saved)
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            continue
        low = start - start % page
        if madvise(low, start + size - low, _MADV_POPULATE_READ) != 0:
            madvise(low, start + size - low, _MADV_WILLNEED)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list):
            yield from _tensors(value)


def save(path: Path, identity: tuple[int, ...], parts: list[Any], held: dict[str, Any]) -> None:
    """Keep `held` (tensors, lists of tensors, numbers) as the entry for these parts, written whole (synced
    before it takes its name) or not at all."""
    global _warned
    folder = _folder(path, identity)
    tmp = None
    try:
        if file_identity(path) != identity:  # replaced or rewritten while it was packed
            return
        if folder.is_dir():
            _remove_other_versions(folder)
        else:
            _remove_stale(folder.parent)
            folder.mkdir(parents=True, exist_ok=True)
            _write_whole(folder / "source.json", json.dumps({"path": os.path.realpath(path),
                                                             "identity": list(identity)}).encode())
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save({key: _own(value) for key, value in held.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / entry_name(parts))
    except Exception as e:  # torch.save reports a full disk as a RuntimeError
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not _warned:
            _warned = True
            reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
            print(f"outrider: cannot keep packed weights under {folder.parent} ({reason}); each load packs its "
                  "file again (OUTRIDER_PACKED_CACHE=0 stops trying)", file=sys.stderr)


def cached(path: Path, identity: tuple[int, ...], parts: list[Any],
           make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The held tensors for these parts: mapped from the cache, or made and kept there."""
    if not enabled_for(path):
        return make()
    held = load(path, identity, parts)
    if held is None:
        held = make()
        save(path, identity, parts, held)
    return held


def _own(value):
    """A tensor saved holds its whole storage: a view of a larger one is saved as a copy of its own."""
    if isinstance(value, list):
        return [_own(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.contiguous()
        if value.untyped_storage().nbytes() != value.numel() * value.element_size():
            value = value.clone()
    return value


def _write_whole(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_other_versions(folder: Path) -> None:
    """Entries made by other packing code, which no load of this code finds, and temporary files an hour old
    (left by a process stopped while it wrote)."""
    for entry in folder.glob("*.pt"):
        if not entry.name.startswith(_code_version() + "-"):
            with contextlib.suppress(OSError):
                entry.unlink()
    for tmp in folder.glob("*.tmp"):
        with contextlib.suppress(OSError):
            if tmp.stat().st_mtime < time.time() - 3600:
                tmp.unlink()


def _remove_stale(root: Path) -> None:
    """Folders whose model file changed since, or is gone, or whose source.json (written whole) makes no sense."""
    if not root.is_dir():
        return
    for source_file in root.glob("*/source.json"):
        try:
            source = json.loads(source_file.read_text())
            if file_identity(Path(source["path"])) == tuple(source["identity"]):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass
        shutil.rmtree(source_file.parent, ignore_errors=True)
