"""What one run measured (the same definitions for every engine), medians over runs, and ratios paired by round."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

from outrider.errors import OutriderError


@dataclass
class RunResult:
    prefill_s: float
    decode_s: float
    n_prompt: int
    n_generated: int
    n_first: int = 1  # tokens in the first delivery; they count to prefill, not to decode
    drafted: int | None = None
    accepted: int | None = None
    rounds: int | None = None
    acceptance_approximate: bool = False  # counted from outside the engine, not by it
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific detail, kept in the JSON only

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        # None when the first delivery held every token (transformers' lookup on a short run): no decode phase
        if self.n_generated <= self.n_first or self.decode_s <= 0:
            return None
        return (self.n_generated - self.n_first) / self.decode_s

    @property
    def acceptance_rate(self) -> float | None:
        if self.drafted is None or self.accepted is None:
            return None
        return self.accepted / self.drafted if self.drafted else None  # nothing drafted: undefined

    @property
    def mean_acceptance_length(self) -> float | None:
        if self.rounds is None or self.accepted is None:
            return None
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "acceptance_rate", "mean_acceptance_length"):
            row[key] = getattr(self, key)
        return row


METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s", "acceptance_rate", "mean_acceptance_length")


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(runs: list[RunResult]) -> dict[str, float | None]:
    return {key: median(getattr(r, key) for r in runs) for key in METRICS}


def timed_stream(tokens: Iterator[Any], n_tokens: int, n_prompt: int) -> tuple[RunResult, list]:
    """Consume `tokens` (an iterator of deliveries: one token, or a list of them) until n_tokens arrived;
    the clock starts before the first `next`, since lazy generators do their prefill there."""
    start = time.perf_counter()
    first_at, n_first, got = None, 0, []
    for delivery in tokens:
        got.extend(delivery if isinstance(delivery, list) else [delivery])
        if first_at is None:
            first_at, n_first = time.perf_counter(), len(got)
        if len(got) >= n_tokens:
            break
    end = time.perf_counter()
    close = getattr(tokens, "close", None)
    if close:
        close()
    if first_at is None:
        raise OutriderError("the engine produced no tokens")
    return RunResult(first_at - start, end - first_at, n_prompt, min(len(got), n_tokens), min(n_first, n_tokens)), got


def paired_ratio(runs: list[dict], base: list[dict], key: str = "decode_tokens_per_s") -> float | None:
    """Median over rounds of runs[i][key] / base[i][key]. A round runs every configuration back to back, so
    the ratio within a round is free of the machine's drift between rounds, which a ratio of two medians
    is not (a slow minute that hits one configuration's median run and not the other's)."""
    ratios = [r[key] / b[key] for r, b in zip(runs, base) if r.get(key) is not None and b.get(key)]
    return statistics.median(ratios) if ratios else None


def _references(config: str) -> dict[str, str]:
    """What an Outrider configuration is compared with: its own plain decoding, llama.cpp plain and with
    prompt lookup, and transformers with the same drafter (plain against plain, lookup against lookup)."""
    return {"vs_outrider_plain": "outrider", "vs_llama_cpp": "llama.cpp", "vs_llama_cpp_lookup": "llama.cpp+lookup",
            "vs_llama_bench": "llama-bench", "vs_transformers": config.replace("outrider", "transformers", 1)}


PAIRED_COLUMNS = {"vs_outrider_plain": "vs Outrider plain", "vs_llama_cpp": "vs llama.cpp",
                  "vs_llama_cpp_lookup": "vs llama.cpp+lookup", "vs_llama_bench": "vs llama-bench",
                  "vs_transformers": "vs transformers", "prefill_vs_llama_cpp": "prefill vs llama.cpp",
                  "prefill_vs_llama_bench": "prefill vs llama-bench"}  # the keys of a cell's "paired"


def add_ratios(cells: list[dict]) -> None:
    """Per cell, decode speed relative to llama.cpp plain on the same prompt and sampling (paired by round);
    per Outrider cell, the paired ratios against `_references` and prefill against llama.cpp."""

    def where(cell: dict) -> tuple:
        return cell["prompt"], cell["temperature"], cell.get("top_p", 1.0)  # reports before top-p cells lack it

    by = {(*where(c), c["config"]): c for c in cells}
    for c in cells:
        base = by.get((*where(c), "llama.cpp"))
        c["median"]["ratio_to_llama_cpp"] = paired_ratio(c["runs"], base["runs"]) if base else None
        if c["engine"] != "outrider":
            continue
        c["paired"] = {}
        for name, reference in _references(c["config"]).items():
            peer = by.get((*where(c), reference))
            c["paired"][name] = paired_ratio(c["runs"], peer["runs"]) if peer and peer is not c else None
        c["paired"]["prefill_vs_llama_cpp"] = (paired_ratio(c["runs"], base["runs"], "prefill_tokens_per_s")
                                               if base else None)
        bench = by.get((*where(c), "llama-bench"))
        c["paired"]["prefill_vs_llama_bench"] = (paired_ratio(c["runs"], bench["runs"], "prefill_tokens_per_s")
                                                 if bench else None)
