"""Acceptor benchmark: the cost of one verify round with a free target (precomputed logits), every
built-in acceptor and sampling setting side by side in one run, each as a ratio to greedy's round.

    python benchmarks/acceptors.py [--vocab 49152 262144] [--k 7] [--rounds 16] [--runs 5] [--threads 0]

For each vocabulary and setting it prints the median over --runs of the mean per-round time over --rounds
rounds, its ratio to the greedy round on the same logits, and the mean number of drafts accepted. The
drafts are the argmax chain of logits peaked the way a language model's are (the top token well ahead, a
long tail), so greedy accepts every draft and the sampled rounds stop at their first rejection.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.spec.acceptance import VerifyRound
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, warp


def make_rounds(vocab: int, k: int, rounds: int, with_q: bool, params: SamplingParams, seed: int = 0):
    """(logits [k+1, V], drafts = the argmax chain, q [k, V] or None) per round: the top token 8 nats ahead
    of a N(0, 2) tail, the way a small model's next-token logits look on ordinary text."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds):
        logits = 2.0 * torch.randn(k + 1, vocab, generator=gen)
        top = torch.randint(0, vocab, (k + 1,), generator=gen)
        logits[torch.arange(k + 1), top] += 8.0 + 4.0 * torch.rand(k + 1, generator=gen)
        drafts = [int(t) for t in logits[:k].argmax(dim=-1)]
        q = warp(logits[:k] + torch.randn(k, vocab, generator=gen), params) if with_q else None
        out.append((logits.contiguous(), drafts, q))
    return out


def per_round_ms(accept, rounds, params, seed: int) -> tuple[float, list[tuple[list[int], int]]]:
    rng = PositionRandom(seed)
    results = []
    start = time.perf_counter()
    for r, (logits, drafts, q) in enumerate(rounds):
        res = accept(VerifyRound(logits, drafts, q, params, rng, 100 + 8 * r))
        results.append((list(res.tokens), res.accepted))
    return (time.perf_counter() - start) * 1e3 / len(rounds), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    parser.add_argument("--k", type=int, default=7, help="drafted tokens per round")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads [torch's default]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cells = [
        ("greedy", GreedyAcceptor(), SamplingParams(0.0), False),
        ("sampled T=0.7", SampledAcceptor(), SamplingParams(0.7), False),
        ("sampled T=0.7 top_p=0.9", SampledAcceptor(), SamplingParams(0.7, top_p=0.9), False),
        ("sampled T=0.7 top_p=0.95", SampledAcceptor(), SamplingParams(0.7, top_p=0.95), False),
        ("sampled T=0.7 top_p=0.9, drafter gives q", SampledAcceptor(), SamplingParams(0.7, top_p=0.9), True),
    ]
    print(f"threads: {torch.get_num_threads()}, k = {args.k} drafts per round, free target (precomputed logits), "
          f"median of {args.runs} runs of {args.rounds} rounds\n")
    print("| vocabulary | acceptor, sampling | ms/round | / greedy | accepted/round |")
    print("|---|---|---|---|---|")
    for vocab in args.vocab:
        greedy_ms = None
        for label, acceptor, params, with_q in cells:
            rounds = make_rounds(vocab, args.k, args.rounds, with_q, params)
            times = []
            for run in range(args.runs + 1):  # run 0 warms up
                t, out = per_round_ms(acceptor.accept, rounds, params, seed=run)
                if run:
                    times.append(t)
            accepted = statistics.mean(a for _, a in out)
            ms = statistics.median(times)
            if label == "greedy":
                greedy_ms = ms
            ratio = f"{ms / greedy_ms:.1f}x" if greedy_ms else "n/a"
            print(f"| {vocab} | {label} | {ms:.2f} | {ratio} | {accepted:.1f} |", flush=True)


if __name__ == "__main__":
    main()
