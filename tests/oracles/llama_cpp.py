"""llama.cpp's own GGUF converter, for test fixtures written the way real files are written.

Tests build tiny random checkpoints with transformers and convert them with llama.cpp's
`convert_hf_to_gguf.py`, run as a subprocess from the source package of llama-cpp-python (which
vendors llama.cpp; PyPI is the one registry our machines reach). The package is downloaded once and the
three parts the converter needs (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) are kept under
`$OUTRIDER_HOME/reference/`. `OUTRIDER_LLAMA_CPP` points at an unpacked llama.cpp tree instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from outrider.paths import outrider_home

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # vendors llama.cpp as of 2026-10-01
_VENDORED = "vendor/llama.cpp/"
_NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ReferenceUnavailable(RuntimeError):
    """llama.cpp's converter could not be fetched (no network, no pip): tests that need it skip."""


def llama_cpp_tree() -> Path:
    """A folder holding llama.cpp's converter, its `conversion` package and its `gguf-py`."""
    if os.environ.get("OUTRIDER_LLAMA_CPP"):
        return Path(os.environ["OUTRIDER_LLAMA_CPP"])
    folder = outrider_home() / "reference" / LLAMA_CPP_PYTHON.replace("==", "-")
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    with tempfile.TemporaryDirectory(prefix="outrider-llama-cpp-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "--disable-pip-version-check", "-d", tmp, LLAMA_CPP_PYTHON]
        result = subprocess.run(cmd, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or not archives:
            last = (result.stderr.strip().splitlines() or ["pip printed nothing"])[-1]
            raise ReferenceUnavailable(f"could not download {LLAMA_CPP_PYTHON} ({last})")
        staging = Path(tmp) / "tree"
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                inner = member.name.split("/", 1)[-1]
                if not inner.startswith(_VENDORED):
                    continue
                rel = inner[len(_VENDORED):]
                if member.isfile() and any(rel == n or rel.startswith(n) for n in _NEEDED):
                    member.name = rel
                    tar.extract(member, staging, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(staging), folder)  # whole or not at all: a half-copied tree is never seen
    return folder


# Runs the converter with `tokenizer.ggml.pre` named rather than detected: the converter knows a BPE
# pre-tokenizer only by the hash of a real vocabulary's ids, which a tiny test vocabulary cannot have.
_NAMED_PRE = """
import runpy, sys
from conversion import base
pre = sys.argv.pop(1)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_hf_to_gguf(hf_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32",
                       extra: tuple[str, ...] = (), pre: str | None = None) -> Path:
    """Run llama.cpp's converter on a transformers checkpoint folder; returns the written .gguf path.
    `pre`: the BPE pre-tokenizer name to write (a tiny byte-level vocabulary's, which the converter cannot
    detect)."""
    tree = llama_cpp_tree()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use its own gguf-py, newer than PyPI's
    script = ["-c", _NAMED_PRE, pre] if pre else [str(tree / "convert_hf_to_gguf.py")]
    cmd = [sys.executable, *script, str(hf_dir), "--outfile", str(out), "--outtype", outtype, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{tail}")
    return Path(out)
