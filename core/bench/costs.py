"""What a decoded token costs: the memory-bandwidth bound on decode speed, the bytes a token reads, and the
cost of a k-token forward relative to a 1-token one (what the adaptive draft length trades against acceptance)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterable

import torch

from outrider.io.gguf import stored_weight_bytes  # noqa: F401  (part of the bench API)


def read_bandwidth_gbs(size_mb: int = 1024, runs: int = 5) -> float:
    """Sustained read bandwidth: a reduction over a buffer far larger than the cache."""
    buffer = torch.ones(size_mb * (1 << 20) // 4)
    buffer.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


_EMBEDDING_NAMES = ("embd", "embed", "tok_emb", "wte")


def tensor_bytes(root: Any) -> int:
    """Bytes of every torch tensor reachable from `root` through attributes, containers and nn.Module
    parameters, each storage counted once: a walk instead of a list of names, so it survives rewrites of
    the model classes. A tensor reached only under an embedding-like name is a row gather, not a per-token
    read, and is left out (a tied output head reaches it under another name too)."""
    counted: dict[int, int] = {}
    embedding_only: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, name = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if any(word in name.lower() for word in _EMBEDDING_NAMES):
                embedding_only.setdefault(key, size)
            else:
                counted[key] = size
            continue
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(v, str(k)) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(v, name) for v in obj]
        elif isinstance(obj, torch.nn.Module):
            stack += [(t, n) for n, t in obj.named_parameters(recurse=False)]
            stack += [(t, n) for n, t in obj.named_buffers(recurse=False)]
            stack += [(m, n) for n, m in obj.named_children()]
            stack += [(v, k) for k, v in vars(obj).items() if not k.startswith("_")]
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("outrider", "__main__", "tests")):
            stack += [(v, k) for k, v in vars(obj).items()]
        elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("outrider"):
            stack += [(getattr(obj, s), s) for s in obj.__slots__ if hasattr(obj, s)]
    return sum(counted.values())


def median_seconds(run, reps: int) -> float:
    """Median seconds of `reps` calls of `run`, after an untimed one (each shape's first pass finds colder caches)."""
    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _prefilled_caches(model, prompt_len: int, count: int, room: int) -> list:
    """`count` caches holding the same random prompt_len-token prefix, with room for `room` more rows."""
    high = min(1000, model.config.vocab_size)
    prompt = torch.randint(0, high, (prompt_len,))
    caches = [model.new_cache(prompt_len + room + 1) for _ in range(count)]
    for cache in caches:
        model.forward(prompt, 0, cache)
    return caches


def forward_seconds(model, ks: Iterable[int], prompt_len: int = 128, reps: int = 5) -> dict[int, float]:
    """Median seconds of one forward over k new tokens after a prompt_len-token prefix, for each k."""
    ks = list(ks)
    high = min(1000, model.config.vocab_size)
    cache, = _prefilled_caches(model, prompt_len, 1, max(ks))
    seconds = {}
    for k in ks:
        block = torch.randint(0, high, (k,))

        def run():
            model.forward(block, prompt_len, cache)
            cache.truncate(prompt_len)
        seconds[k] = median_seconds(run, reps)
    return seconds


def ragged_forward_seconds(model, rows: Iterable[int], sequences: Iterable[int], prompt_len: int = 128,
                           reps: int = 5) -> dict[tuple[int, int], float]:
    """Median seconds of one `forward_sequences` over R rows split as evenly as may be across B sequences (each
    over its own cache, after the same prompt_len-token prefix), for each (R, B) with B <= R: what a batched
    step's verify costs beside one sequence's R rows (`forward_seconds`)."""
    rows, sequences = list(rows), list(sequences)
    high = min(1000, model.config.vocab_size)
    caches = _prefilled_caches(model, prompt_len, max(sequences), max(rows))
    seconds = {}
    for r in rows:
        for b in (b for b in sequences if b <= r):
            counts = [r // b + (i < r % b) for i in range(b)]
            block = torch.randint(0, high, (r,))

            def run():
                model.forward_sequences(block, counts, [prompt_len] * b, caches[:b])
                for cache in caches[:b]:
                    cache.truncate(prompt_len)
            seconds[r, b] = median_seconds(run, reps)
    return seconds


def relative_costs(seconds: dict[int, float]) -> dict[int, float]:
    """Each k's time over the first k's (the cost curve in single steps)."""
    first = seconds[next(iter(seconds))]
    return {k: v / first for k, v in seconds.items()}


def forward_cost_curve(model, ks: Iterable[int], prompt_len: int = 128, reps: int = 5) -> dict[int, float]:
    """Median time of one forward over k new tokens, relative to k = 1, after a prompt_len-token prefix."""
    return relative_costs(forward_seconds(model, ks, prompt_len, reps))
