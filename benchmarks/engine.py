"""Engine benchmark: Outrider's plain decode speed beside the memory-bandwidth bound, and the cost of
verifying k tokens in one forward relative to one token. The side-by-side comparison with peers and
drafters is `outrider bench`; this keeps the engine-only view (the helpers live in `outrider.bench`).

    python benchmarks/engine.py [--models smollm2-135m gemma3-270m] [--tokens 64] [--runs 3] [--dtype float32]

Everything is measured in this one run, on this machine; medians of --runs repetitions.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from outrider.assembly import assemble
from outrider.bench import forward_cost_curve, read_bandwidth_gbs, stored_weight_bytes, tensor_bytes
from outrider.config import resolve_config
from outrider.spec.sampling import SamplingParams


def decode_tokens_per_s(runner, n_tokens: int) -> float:
    prompt = torch.randint(0, min(1000, runner.vocab_size), (32,)).tolist()
    list(runner.generate(prompt, n_tokens, SamplingParams(), frozenset()))
    return (runner.stats.generated_tokens - 1) / runner.stats.decode_s  # the first token comes from the prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    bandwidth = read_bandwidth_gbs()
    print(f"threads: {torch.get_num_threads()}, measured read bandwidth: {bandwidth:.1f} GB/s, dtype {args.dtype}\n")
    print("| model | decode tok/s (median) | bound at GGUF size | bound at in-memory size | fraction of in-memory bound |")
    print("|---|---|---|---|---|")
    curves = {}
    for name in args.models:
        assembly = assemble(resolve_config({"model": name, "drafter": "none"}, None, {},
                                           [("backend.dtype", args.dtype)]))
        model = assembly.runner.target.model
        stored, held = stored_weight_bytes(assembly.gguf), tensor_bytes(model)
        decode_tokens_per_s(assembly.runner, 8)  # warm-up
        speed = statistics.median(decode_tokens_per_s(assembly.runner, args.tokens) for _ in range(args.runs))
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
