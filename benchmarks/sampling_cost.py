"""What sampling costs a decode step: plain decoding greedy beside temperature, top-k, top-p and min-p, on a
model with a large vocabulary (Gemma 3: 262,144 tokens), configurations alternated within every round, medians.

    python benchmarks/sampling_cost.py [--model gemma3-270m] [--tokens 64] [--runs 5] [--threads 2]

For each setting it prints decode tok/s and the cost over greedy as a share of a greedy step (the issue's bound:
3%), and the time of the draw alone on one row of logits: `sample_logits` (what decoding runs) and the
reference it stands for, `sample_at(warp(...))`. Name the CPU's vector extensions
beside any figure you quote (docs/bench/cpu.md holds the runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "T=0.8": (0.8, 0, 1.0, 0.0),
    "T=0.8 top-p 0.95": (0.8, 0, 0.95, 0.0),
    "T=0.8 min-p 0.05": (0.8, 0, 1.0, 0.05),
    "T=0.8 top-k 40 top-p 0.95 min-p 0.05": (0.8, 40, 0.95, 0.05),
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    from outrider.assembly import assemble
    from outrider.config import resolve_config
    from outrider.serve.engine import acceptors_by_greediness
    from outrider.spec.random_streams import PositionRandom
    from outrider.spec.sampling import SamplingParams, sample_at, sample_logits, warp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    config = resolve_config({"model": args.model, "drafter": "none"},
                            option_flags=[("backend.threads", str(args.threads))])
    assembly = assemble(config)
    runner, tokenizer = assembly.runner, assembly.tokenizer
    acceptors = acceptors_by_greediness(assembly, "auto")  # greedy at T=0, the Leviathan rule above, as served
    prompt = tokenizer.encode(PROMPT)
    params = {name: SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
              for name, (t, k, p, m) in SETTINGS.items()}
    speeds = {name: [] for name in SETTINGS}
    for run in range(args.runs + 1):  # the first round warms up
        for name, p in params.items():
            # no stop token: every setting decodes the same number of steps over the same lengths of context
            runner.acceptor = acceptors[p.greedy]
            out = list(runner.generate(prompt, args.tokens, p, frozenset()))
            assert len(out) == args.tokens
            if run:
                speeds[name].append((args.tokens - 1) / runner.stats.decode_s)
    logits = runner.target.model.forward(torch.tensor(prompt), 0, runner.target.model.new_cache(len(prompt)),
                                         last_only=True)[0].float()
    rng = PositionRandom(1)
    print(f"{args.model}: vocabulary {logits.shape[-1]}, {args.tokens} tokens, {args.runs} rounds, "
          f"{args.threads} threads; medians\n")
    print("| setting | decode tok/s | cost over greedy, share of a greedy step | sample_logits, ms | "
          "sample_at(warp), ms |")
    print("|---|---|---|---|---|")
    greedy = statistics.median(speeds["greedy"])
    for name, p in params.items():
        drawn = [timed(lambda: sample_logits(logits, p, rng.uniform(i))) for i in range(50)]
        reference = [timed(lambda: sample_at(warp(logits, p), rng.uniform(i))) for i in range(50)]
        speed = statistics.median(speeds[name])
        print(f"| {name} | {speed:.1f} | {greedy / speed - 1:+.1%} | {statistics.median(drawn) * 1e3:.2f} | "
              f"{statistics.median(reference) * 1e3:.2f} |")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

if __name__ == "__main__":
    main()
