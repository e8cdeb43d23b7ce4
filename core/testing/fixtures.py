"""What the contract checks run on: tiny random-weight GGUF models written on the fly, loaded once, and the
independent oracles (plain decoding written as the obvious loop) their outputs are compared with."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from outrider.io.gguf import GGUFFile
from outrider.io.tokenizer import Tokenizer
from outrider.spec.drafter import Target
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, sample_at, warp
from outrider.testing.tiny_models import (
    write_tiny_gemma3,
    write_tiny_gemma4,
    write_tiny_gemma4_assistant,
    write_tiny_llama,
    write_tiny_mtp_sidecar,
)

ARCHITECTURES = ("llama", "gemma3", "gemma4")


def plain_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding: a fresh full forward per token, no cache reuse, no drafter."""
    device = getattr(model, "device", torch.device("cpu"))
    tokens = list(prompt)
    for _ in range(n):
        logits = model.forward(torch.tensor(tokens, device=device), 0, model.new_cache(len(tokens)))[-1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def plain_sampled(model: Any, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Plain sampling: token at position i is sample_at(warp(p_i), rng.uniform(i)) (the PositionRandom rule)."""
    device = getattr(model, "device", torch.device("cpu"))
    rng = PositionRandom(params.seed)
    tokens = list(prompt)
    for _ in range(n):
        logits = model.forward(torch.tensor(tokens, device=device), 0, model.new_cache(len(tokens)))[-1]
        tokens.append(sample_at(warp(logits.float().cpu(), params), rng.uniform(len(tokens))))
    return tokens[len(prompt):]


def builtin_plugin(kind: str, name: str):
    """A built-in plugin's class, found through the registry (the core imports no plugin module); the
    built-ins only, so no third-party package is loaded or can shadow one."""
    return _builtin_registry().get(kind, name).factory


@functools.lru_cache(maxsize=1)
def _builtin_registry():
    from outrider.registry import build_registry

    return build_registry(third_party=False)


def cpu_target(path: str | Path) -> Target:
    """The model file at `path` loaded on the CPU backend (float32), with its tokenizer."""
    gguf = GGUFFile(path)
    backend = builtin_plugin("backend", "cpu")()
    return Target(model=backend.load_model(gguf), tokenizer=Tokenizer.from_gguf(gguf), gguf=gguf, backend=backend)


class ContractFixtures:
    """Tiny models in `folder`, written on first use and loaded once on the CPU backend (float32)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._targets: dict[str, Target] = {}
        self._oracles: dict[tuple, list[int]] = {}

    @functools.cached_property
    def tiny_llama_path(self) -> Path:
        return write_tiny_llama(self.folder / "tiny-llama.gguf", seed=0)

    @functools.cached_property
    def tiny_draft_llama_path(self) -> Path:
        """A smaller llama with the tiny llama's vocabulary: the draft model for drafters that need one. One layer
        of the same seed, so it shares the tiny llama's embedding, output and first layer: its q is close to the
        target's p but not equal, and drafts are often accepted (a draft that never is would hide a biased rule)."""
        return write_tiny_llama(self.folder / "tiny-llama-draft-seed0.gguf", seed=0, n_layers=1)

    @functools.cached_property
    def tiny_mtp_sidecar_path(self) -> Path:
        """An MTP head (one nextn block) for the tiny llama: for drafters that need one."""
        return write_tiny_mtp_sidecar(self.folder / "tiny-llama.mtp.gguf", "llama", self.tiny_llama_path, seed=2)

    @functools.cached_property
    def tiny_gemma3_path(self) -> Path:
        return write_tiny_gemma3(self.folder / "tiny-gemma3.gguf", seed=0)

    @functools.cached_property
    def tiny_qwen2_path(self) -> Path:
        """The tiny llama's block with q/k/v biases (the GPU tests' qwen2; transformers checks the architecture
        itself in tests/test_qwen.py)."""
        return write_tiny_llama(self.folder / "tiny-qwen2.gguf", seed=0, arch="qwen2")

    @functools.cached_property
    def tiny_qwen3_path(self) -> Path:
        """The tiny llama's block with per-head q/k norms, a head wider than hidden / heads, and a tied head."""
        return write_tiny_llama(self.folder / "tiny-qwen3.gguf", seed=0, arch="qwen3", head_dim=32, tied=True)

    @functools.cached_property
    def tiny_gemma4_path(self) -> Path:
        """A tiny Gemma 4 written with the converter's keys and names (no transformers needed): the target of
        drafters that draft only for Gemma 4."""
        return write_tiny_gemma4(self.folder / "tiny-gemma4.gguf", seed=0)

    @functools.cached_property
    def tiny_gemma4_assistant_path(self) -> Path:
        """A tiny Gemma 4 assistant (dense head) matched to `tiny_gemma4_path`, written the same way (no
        transformers, no converter): the draft model of drafters that need one."""
        return write_tiny_gemma4_assistant(self.folder / "tiny-gemma4-assistant.gguf", self.tiny_gemma4_path, seed=0)

    def model_path(self, arch: str) -> Path:
        paths = {"llama": "tiny_llama_path", "gemma3": "tiny_gemma3_path", "gemma4": "tiny_gemma4_path",
                 "qwen2": "tiny_qwen2_path", "qwen3": "tiny_qwen3_path"}
        if arch not in paths:
            raise ValueError(f"no tiny model for architecture {arch!r}; have {', '.join(paths)}")
        return getattr(self, paths[arch])

    def target(self, arch: str = "llama") -> Target:
        if arch not in self._targets:
            self._targets[arch] = cpu_target(self.model_path(arch))
        return self._targets[arch]

    def plain_greedy(self, arch: str, prompt: list[int], n: int) -> list[int]:
        key = ("greedy", arch, tuple(prompt), n)
        if key not in self._oracles:
            self._oracles[key] = plain_greedy(self.target(arch).model, prompt, n)
        return self._oracles[key]

    def plain_sampled(self, arch: str, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
        key = ("sampled", arch, tuple(prompt), n, params)
        if key not in self._oracles:
            self._oracles[key] = plain_sampled(self.target(arch).model, prompt, n, params)
        return self._oracles[key]
