"""Packed weights kept on disk, so that a model file is repacked once, not at every start.

Turning a GGUF file's blocks into the forms the kernels read (`outrider.models.linear.load_packed`: codes,
scales, the lane form) is numpy and torch work over every weight, seconds per model on a small machine, where
llama.cpp maps its file and starts. So the first load of a file saves what it made under
`$OUTRIDER_HOME/packed/`, one folder per model file, and later loads map those tensors (`torch.load(mmap=True)`):
no copy is made until a page is read, as with the GGUF file itself.

An entry is found by everything its tensors depend on: the file (path, size, modification time), the tensors
and the rows each takes (a row map is known by the rows it picks), the form asked for (lane form or not), this
build's and environment's choices of form (lane tiles, factored scales, six-bit codes, int8 activations), and
the source of the code that packs (`linear.py` and this file), so a change there makes new entries. A folder
whose file changed or is gone is removed when the next entry is written.

`OUTRIDER_PACKED_CACHE=0` turns it off, `=1` keeps files of any size; by default files of MIN_FILE_BYTES or
more, so the small files tests and tools write and delete leave nothing behind. A cache that cannot be
written (a full disk, a read-only home) costs a warning, once; an entry that cannot be read is packed again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
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


@functools.cache
def _code_version() -> str:
    """The packing code's own source: entries made by other code are not found."""
    here = Path(__file__).parent
    return hashlib.sha256((here / "linear.py").read_bytes() + Path(__file__).read_bytes()).hexdigest()


def file_folder(path: Path) -> tuple[Path, dict[str, Any]]:
    """The folder of a model file's entries, and what identifies the file's present contents."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    source = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
    return outrider_home() / "packed" / f"{Path(real).stem[:60]}-{digest}", source


def entry_name(parts: list[Any]) -> str:
    """A name for an entry from what it depends on: strings, numbers and tensors (by their values)."""
    h = hashlib.sha256(_code_version().encode())
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(part.contiguous().numpy().tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32] + ".pt"


def load(path: Path, parts: list[Any]) -> dict[str, Any] | None:
    """The entry for these parts of the model file at `path`, its tensors mapped, or None."""
    folder, _ = file_folder(path)
    entry = folder / entry_name(parts)
    if not entry.is_file():
        return None
    try:
        return torch.load(entry, mmap=True, weights_only=True)
    except Exception:  # a torn or foreign file: pack again, and let the new entry replace it
        entry.unlink(missing_ok=True)
        return None


def save(path: Path, parts: list[Any], held: dict[str, Any]) -> None:
    """Keep `held` (tensors, lists of tensors, numbers) as the entry for these parts, written whole or not at all."""
    global _warned
    folder, source = file_folder(path)
    entry = folder / entry_name(parts)
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        if not folder.is_dir():
            _remove_stale(folder.parent)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "source.json").write_text(json.dumps(source))
        torch.save({key: _own(value) for key, value in held.items()}, tmp)
        os.replace(tmp, entry)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not _warned:
            _warned = True
            print(f"outrider: cannot keep packed weights under {folder.parent} ({e.strerror or e}); each load "
                  "packs its file again (OUTRIDER_PACKED_CACHE=0 stops trying)", file=sys.stderr)


def cached(path: Path, parts: list[Any], make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The held tensors for these parts: mapped from the cache, or made and kept there."""
    if not enabled_for(path):
        return make()
    held = load(path, parts)
    if held is None:
        held = make()
        save(path, parts, held)
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


def _remove_stale(root: Path) -> None:
    """Folders whose model file changed since, or is gone."""
    if not root.is_dir():
        return
    for source_file in root.glob("*/source.json"):
        try:
            source = json.loads(source_file.read_text())
            stat = os.stat(source["path"])
            if stat.st_size == source["size"] and stat.st_mtime_ns == source["mtime_ns"]:
                continue
        except (OSError, ValueError, KeyError):
            pass
        shutil.rmtree(source_file.parent, ignore_errors=True)
