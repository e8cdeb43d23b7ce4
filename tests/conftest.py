"""Shared pytest fixtures. Each block below belongs to one area; add yours as a separate, marked block."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

# ------------------------------------------------------------------------------------------------------
# Test-only oracles (tests/oracles/: transformers' models and llama.cpp's converter, kept out of the wheel).
# Tests run with --import-mode=importlib, which puts no test folder on sys.path: this one goes first, so that
# `from oracles.gemma4_assistant import ...` works under `pytest` and `python -m pytest` from any folder.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# ------------------------------------------------------------------------------------------------------
# Real model files (shared; written with the tokenizer tests).
# Tests that use these must be marked @pytest.mark.slow. Point the env vars at local copies to skip the
# catalog download, e.g.
#   OUTRIDER_TEST_SMOLLM2=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
#   OUTRIDER_TEST_GEMMA3=/tmp/models/gemma-3-270m-q4_k_m.gguf
#   OUTRIDER_TEST_QWEN05=/tmp/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#   OUTRIDER_TEST_QWEN15=/tmp/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf


def _real_model_path(env_var: str, catalog_name: str) -> Path:
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    from outrider.catalog import ensure_model  # imported late: only tests that need a real model pull one

    return Path(ensure_model(catalog_name))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _real_model_path("OUTRIDER_TEST_SMOLLM2", "smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _real_model_path("OUTRIDER_TEST_GEMMA3", "gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _real_model_path("OUTRIDER_TEST_QWEN05", "qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return _real_model_path("OUTRIDER_TEST_QWEN15", "qwen2.5-coder-1.5b")


# ------------------------------------------------------------------------------------------------------
# transformers' reading of a real GGUF file, the oracle of the slow tests: loaded once per session, since
# transformers parses the file's metadata (the whole vocabulary) in Python for the tokenizer and again for the
# model, a minute and more for a 150k-token vocabulary on 2 cores.


class TransformersGGUF:
    """transformers' tokenizer and float32 model of a GGUF file, each read once; shared, so a test must not
    change them."""

    @staticmethod
    def _args(path: Path) -> tuple[str, str]:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return os.path.split(str(path))

    @functools.cache
    def tokenizer(self, path: Path):
        import transformers

        folder, name = self._args(path)
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)

    @functools.cache
    def model(self, path: Path):
        import torch
        import transformers

        folder, name = self._args(path)
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def transformers_gguf() -> TransformersGGUF:
    pytest.importorskip("transformers")  # before a test's real model is fetched
    return TransformersGGUF()
