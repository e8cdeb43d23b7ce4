"""Engine benchmark: plain decode speed beside the memory-bandwidth bound, and the cost of verifying k
tokens in one forward relative to one token.

    python benchmarks/engine.py [--models smollm2-135m gemma3-270m] [--tokens 64] [--runs 3] [--dtype float32]

Everything is measured in this one run, on this machine; medians of --runs repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider.catalog import resolve_model
from outrider.gguf_file import GGUFFile
from outrider.models import load_model


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


def weight_bytes(model, gguf: GGUFFile) -> tuple[int, int]:
    """Bytes read per decoded token: (as stored in the GGUF, as held in memory by this model).
    The input embedding is a row gather, so it counts only when it doubles as the output head."""
    stored = sum(info.nbytes for name, info in gguf.tensors.items() if name != "token_embd.weight")
    if "output.weight" not in gguf.tensors:
        stored += gguf.tensors["token_embd.weight"].nbytes
    seen, held = set(), 0
    tensors = [model.output, model.output_norm] + [t for layer in model.layers for t in vars(layer).values()
                                                   if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held += t.numel() * t.element_size()
    return stored, held


def decode_tokens_per_s(model, n_tokens: int, prompt_len: int = 32) -> float:
    cache = model.new_cache(prompt_len + n_tokens + 1)
    tokens = torch.randint(10, 1000, (prompt_len,))
    logits = model.forward(tokens, 0, cache)
    token = int(logits[-1].argmax())
    t = time.perf_counter()
    for i in range(n_tokens):
        token = int(model.forward(torch.tensor([token]), prompt_len + i, cache)[-1].argmax())
    return n_tokens / (time.perf_counter() - t)


def forward_cost_curve(model, ks: range, prompt_len: int = 128, reps: int = 5) -> dict[int, float]:
    cache = model.new_cache(prompt_len + max(ks) + 1)
    model.forward(torch.randint(10, 1000, (prompt_len,)), 0, cache)
    seconds = {}
    for k in ks:
        block = torch.randint(10, 1000, (k,))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            model.forward(block, prompt_len, cache)
            times.append(time.perf_counter() - t)
            cache.truncate(prompt_len)
        seconds[k] = statistics.median(times)
    return {k: seconds[k] / seconds[1] for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    bandwidth = read_bandwidth_gbs()
    print(f"threads: {torch.get_num_threads()}, measured read bandwidth: {bandwidth:.1f} GB/s, dtype {args.dtype}\n")
    print("| model | decode tok/s (median) | bound at GGUF size | bound at in-memory size | fraction of in-memory bound |")
    print("|---|---|---|---|---|")
    curves = {}
    for name in args.models:
        gguf = GGUFFile(resolve_model(name))
        model = load_model(gguf, dtype=dtype)
        stored, held = weight_bytes(model, gguf)
        decode_tokens_per_s(model, 8)  # warm-up
        speed = statistics.median(decode_tokens_per_s(model, args.tokens) for _ in range(args.runs))
        bound_stored, bound_held = bandwidth * 1e9 / stored, bandwidth * 1e9 / held
        print(f"| {name} | {speed:.1f} | {bound_stored:.0f} ({stored / 1e6:.0f} MB/token) | "
              f"{bound_held:.0f} ({held / 1e6:.0f} MB/token) | {speed / bound_held:.0%} |")
        curves[name] = forward_cost_curve(model, range(1, 17))
    print("\ncost of a k-token forward relative to a 1-token forward (median of 5):\n")
    print("| k | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for k in range(1, 17):
        print(f"| {k} | " + " | ".join(f"{curves[name][k]:.2f}" for name in curves) + " |")


if __name__ == "__main__":
    main()
