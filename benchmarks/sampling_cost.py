"""What sampling costs a decode step: plain decoding greedy beside temperature, top-k, top-p and min-p, on a
model with a large vocabulary (Gemma 3: 262,144 tokens), Outrider beside llama-server on the same file and
threads, configurations and engines alternated within every round, medians.

    python benchmarks/sampling_cost.py [--model gemma3-270m] [--tokens 64] [--runs 5] [--threads 2] [--no-llama]

For each setting and engine it prints decode tok/s (prefill excluded; every run decodes --tokens, end of text
ignored) and the cost over the same engine's greedy as a share of a greedy step (the issue's bound: 3%), the
ratio of Outrider's speed to llama-server's, and the time of Outrider's draw alone on one row of logits:
`sample_logits` (what decoding runs) and the reference it stands for, `sample_at(warp(...))`. llama-server:
`$LLAMA_SERVER`, else the `build-llama-cpp --no-amx` build (qwen_pair.py); for the AVX2 path on an AVX-512
machine, `OUTRIDER_NATIVE_MARCH=x86-64-v3` and `LLAMA_SERVER=` the `--avx2` build's. Name the CPU's vector
extensions beside any figure you quote (docs/bench/cpu.md holds the runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # qwen_pair.py's llama-server driver
from qwen_pair import LlamaServer, llama_server_binary  # noqa: E402

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
    from outrider.catalog import resolve_model
    from outrider.config import resolve_config
    from outrider.serve.engine import acceptors_by_greediness
    from outrider.spec.random_streams import PositionRandom
    from outrider.spec.sampling import SamplingParams, sample_at, sample_logits, warp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-llama", action="store_true", help="Outrider alone")
    args = parser.parse_args()
    config = resolve_config({"model": args.model, "drafter": "none"},
                            option_flags=[("backend.threads", str(args.threads))])
    assembly = assemble(config)
    runner, tokenizer = assembly.runner, assembly.tokenizer
    acceptors = acceptors_by_greediness(assembly, "auto")  # greedy at T=0, the Leviathan rule above, as served
    prompt = tokenizer.encode(PROMPT)
    params = {name: SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
              for name, (t, k, p, m) in SETTINGS.items()}
    llama = None if args.no_llama else LlamaServer(llama_server_binary(), resolve_model(args.model), None, [],
                                                   args.threads)
    speeds = {(engine, name): [] for engine in ("outrider", "llama") for name in SETTINGS}
    try:
        for run in range(args.runs + 1):  # the first round warms up
            for name, p in params.items():
                # no stop token: every setting decodes the same number of steps over the same lengths of context
                runner.acceptor = acceptors[p.greedy]
                out = list(runner.generate(prompt, args.tokens, p, frozenset()))
                assert len(out) == args.tokens
                if run:
                    speeds["outrider", name].append((args.tokens - 1) / runner.stats.decode_s)
                if llama is not None:
                    t, k, top_p, m = SETTINGS[name]
                    tok_s, _, _ = llama.decode(PROMPT, args.tokens, t, 1 + run, top_k=k, top_p=top_p, min_p=m,
                                               ignore_eos=True)
                    if run:
                        speeds["llama", name].append(tok_s)
    finally:
        if llama is not None:
            llama.close()
    logits = runner.target.model.forward(torch.tensor(prompt), 0, runner.target.model.new_cache(len(prompt)),
                                         last_only=True)[0].float()
    rng = PositionRandom(1)
    print(f"{args.model}: vocabulary {logits.shape[-1]}, {args.tokens} tokens, {args.runs} rounds, "
          f"{args.threads} threads; medians\n")
    print("| setting | Outrider tok/s, cost over its greedy | llama-server tok/s, cost over its greedy | "
          "Outrider / llama-server | sample_logits, ms | sample_at(warp), ms |")
    print("|---|---|---|---|---|---|")
    median = {key: statistics.median(values) if values else float("nan") for key, values in speeds.items()}
    for name, p in params.items():
        drawn = [timed(lambda: sample_logits(logits, p, rng.uniform(i))) for i in range(50)]
        reference = [timed(lambda: sample_at(warp(logits, p), rng.uniform(i))) for i in range(50)]
        ours, theirs = median["outrider", name], median["llama", name]
        print(f"| {name} | {ours:.1f}, {median['outrider', 'greedy'] / ours - 1:+.1%} | "
              f"{theirs:.1f}, {median['llama', 'greedy'] / theirs - 1:+.1%} | {ours / theirs:.2f}x | "
              f"{statistics.median(drawn) * 1e3:.2f} | {statistics.median(reference) * 1e3:.2f} |")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
