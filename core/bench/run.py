"""The benchmark itself: its settings, and every cell run interleaved round by round."""

from __future__ import annotations

import gc
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from outrider import native
from outrider.bench import prompts
from outrider.bench.costs import forward_seconds, read_bandwidth_gbs, relative_costs, stored_weight_bytes
from outrider.bench.engines import DRAFTERS, ENGINES, SINGLE_DRAFTERS, LlamaBenchEngine, OutriderEngine, make_engines
from outrider.bench.results import add_ratios, medians
from outrider.errors import ConfigError

DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
COST_CURVE_KS = range(1, 17)  # forward lengths of the cost curve: every verify a draft of up to 15 needs
COST_CURVE_PREFIX, COST_CURVE_REPS = 128, 5  # tokens in the cache before each forward; forwards per k


@dataclass(frozen=True)
class Sampling:
    """What a cell samples at: a temperature (0 = greedy) and a top-p (1 = off), written `0.7` or `0.7@0.95`."""

    temperature: float
    top_p: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> Sampling:
        temperature, at, top_p = spec.strip().partition("@")
        try:
            return cls(float(temperature), float(top_p) if at else 1.0)
        except ValueError:
            raise ConfigError(f"--temperatures takes T or T@top_p (e.g. 0,0.7,0.7@0.95), got '{spec}'") from None

    def check(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperatures must be >= 0, got {self.temperature:g}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1] (1 = off), got {self}")
        if self.top_p < 1 and self.temperature == 0:
            raise ConfigError(f"top-p needs a temperature above 0 (greedy ignores it), got {self}")

    def __str__(self) -> str:
        return f"{self.temperature:g}" + (f"@{self.top_p:g}" if self.top_p < 1 else "")


# greedy, plain sampling, and what chat front-ends send (temperature 0.7 with top-p 0.95)
DEFAULT_SAMPLINGS = (Sampling(0.0), Sampling(0.7), Sampling(0.7, 0.95))


@dataclass
class BenchSettings:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    tokens: int = 128
    runs: int = 3
    threads: int = 0  # 0 = torch's current setting
    prompts: list[str] = field(default_factory=lambda: list(prompts.PROMPTS))
    samplings: list[Sampling] = field(default_factory=lambda: list(DEFAULT_SAMPLINGS))
    engines: list[str] = field(default_factory=lambda: list(ENGINES))
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    chat: bool = True
    seed: int = 1
    draft_max: int | str = "auto"
    bandwidth: bool = True
    cost_curve: bool = False
    options: list[tuple[str, str]] = field(default_factory=list)  # -o KEY VALUE for every Outrider configuration
    llama_bench: str = ""  # llama.cpp's llama-bench binary ("" = $LLAMA_BENCH, else the engine is skipped)

    def check(self) -> None:
        if self.tokens < 2:
            raise ConfigError("--tokens must be at least 2 (one for prefill, one or more for decode)")
        if self.runs < 1:
            raise ConfigError("--runs must be at least 1")
        for p in self.prompts:
            if p not in prompts.PROMPTS:
                raise ConfigError(f"unknown prompt '{p}'; choose from {', '.join(prompts.PROMPTS)}")
        for e in self.engines:
            if e not in ENGINES:
                raise ConfigError(f"unknown engine '{e}'; choose from {', '.join(ENGINES)}")
        for d in self.drafters:
            parts = d.split("+")
            if any(p not in SINGLE_DRAFTERS for p in parts) or ("none" in parts and len(parts) > 1):
                raise ConfigError(f"unknown drafter '{d}'; choose from {', '.join(SINGLE_DRAFTERS)}, or join "
                                  "drafters with + to combine them (lookup+mtp)")
        for sampling in self.samplings:
            sampling.check()


def run_bench(settings: BenchSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every cell, interleaved; return the report (raw runs and medians), printing notes as it goes."""
    from outrider.catalog import resolve_model
    from outrider.io.gguf import GGUFFile

    settings.check()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    threads = torch.get_num_threads()
    report: dict[str, Any] = {"settings": {**asdict(settings), "samplings": [str(s) for s in settings.samplings],
                                           "threads": threads}, "notes": [],
                              "machine": _machine(), "models": {}}

    def note(text: str) -> None:
        report["notes"].append(text)
        echo(f"note: {text}")

    if settings.bandwidth:
        report["machine"]["read_bandwidth_gbs"] = read_bandwidth_gbs()

    for model in settings.models:
        path = str(resolve_model(model))
        ids, templated = {}, True
        for p in settings.prompts:
            ids[p], applied = prompts.prompt_ids(path, prompts.PROMPTS[p], settings.chat)
            templated = templated and applied
        if settings.chat and not templated:
            note(f"{model}: no chat template; the prompts are fed as raw text")

        engines = []
        for engine in make_engines(settings.engines, settings.drafters, path, threads, settings.draft_max,
                                   settings.llama_bench or None, settings.options):
            try:
                engine.load()
                engines.append(engine)
            except ImportError as exc:
                note(f"{model}: {engine.label} skipped: {exc.name or exc} is not installed "
                     "(pip install 'outrider[bench]'; see scripts/install-peers)")
            except Exception as exc:  # a peer that cannot read this file must not sink the rest of the run
                note(f"{model}: {engine.label} skipped: {type(exc).__name__}: {exc}")

        entry: dict[str, Any] = {"path": path, "prompt_tokens": {p: len(v) for p, v in ids.items()},
                                 "chat_template": settings.chat and templated, "cells": []}
        gguf = GGUFFile(path)
        entry["stored_weight_bytes"] = stored_weight_bytes(gguf)
        plain = next((e for e in engines if isinstance(e, OutriderEngine) and e.drafter == "none"),
                     next((e for e in engines if isinstance(e, OutriderEngine)), None))
        if plain is not None:
            entry["held_weight_bytes"] = plain.held_bytes()
        bandwidth = report["machine"].get("read_bandwidth_gbs")
        if bandwidth:
            entry["bound_stored_tokens_per_s"] = bandwidth * 1e9 / entry["stored_weight_bytes"]
            if entry.get("held_weight_bytes"):
                entry["bound_held_tokens_per_s"] = bandwidth * 1e9 / entry["held_weight_bytes"]

        cells = {(p, s, e.label): [] for p in settings.prompts for s in settings.samplings for e in engines}
        failed: set[str] = set()
        for round_index in range(settings.runs + 1):  # round 0 warms caches, allocators and JITs up
            for p in settings.prompts:
                for s in settings.samplings:
                    for engine in engines:
                        if engine.label in failed:
                            continue
                        try:
                            result = engine.run(ids[p], settings.tokens, s.temperature, s.top_p,
                                                settings.seed + round_index)
                        except Exception as exc:
                            failed.add(engine.label)
                            note(f"{model}: {engine.label} failed and is dropped: {type(exc).__name__}: {exc}")
                            continue
                        if round_index:
                            cells[(p, s, engine.label)].append(result)
            echo(f"{model}: {'warm-up' if not round_index else f'run {round_index}/{settings.runs}'} done")

        for (p, s, label), runs in cells.items():
            if not runs:
                continue
            engine = next(e for e in engines if e.label == label)
            entry["cells"].append({"prompt": p, "temperature": s.temperature, "top_p": s.top_p,
                                   "engine": engine.engine, "config": label,
                                   "acceptance_approximate": any(r.acceptance_approximate for r in runs),
                                   "median": medians(runs), "runs": [r.as_dict() for r in runs]})
        add_ratios(entry["cells"])

        if settings.cost_curve and plain is not None:
            seconds = forward_seconds(plain.assembly.runner.target.model, COST_CURVE_KS, COST_CURVE_PREFIX,
                                      COST_CURVE_REPS)
            entry["forward_cost_setup"] = {"prefix": COST_CURVE_PREFIX, "reps": COST_CURVE_REPS}
            entry["forward_cost_curve"] = {str(k): v for k, v in relative_costs(seconds).items()}
            entry["forward_ms"] = {str(k): 1e3 * v for k, v in seconds.items()}
            for peer in (e for e in engines if isinstance(e, LlamaBenchEngine)):
                try:  # the peer's verify cost beside ours: a ratio alone hides how fast the single step is
                    theirs = peer.forward_seconds(COST_CURVE_KS, COST_CURVE_PREFIX, COST_CURVE_REPS)
                except Exception as exc:
                    note(f"{model}: {peer.label} cost curve skipped: {type(exc).__name__}: {exc}")
                    continue
                entry.setdefault("peer_forward_cost_curve", {})[peer.label] = {
                    str(k): v for k, v in relative_costs(theirs).items()}
                entry.setdefault("peer_forward_ms", {})[peer.label] = {str(k): 1e3 * v for k, v in theirs.items()}
        for engine in engines:
            engine.close()
        del engines, plain
        gc.collect()
        report["models"][model] = entry
    return report


def _machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "vector_extensions": native.vector_extensions(),
            "kernel_cflags": native.cflags()}
    for package in ("llama_cpp", "transformers"):
        try:
            module = __import__(package)
            info[package] = getattr(module, "__version__", "?")
        except Exception:
            info[package] = None
    return info
