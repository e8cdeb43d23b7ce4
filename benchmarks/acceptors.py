"""Acceptor benchmark: the cost of one verify round with a free target (precomputed logits), today's
acceptors beside the code they replaced (kept below as `reference_*`), in one run.

    python benchmarks/acceptors.py [--vocab 49152 262144] [--k 7] [--rounds 16] [--runs 5] [--threads 0]

For each vocabulary and setting it prints the median over --runs of the mean per-round time over --rounds
rounds, for the old and the new code on the same logits, drafts and seeds, their ratio, and the mean number
of drafts accepted. The two must emit the same tokens in every round (checked: the benchmark stops if not).
The drafts are the argmax chain of logits peaked the way a language model's are (the top token well ahead,
a long tail), so greedy accepts every draft and the sampled rounds stop at their first rejection.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.sampling import AcceptResult, PositionRandom, SamplingParams, sample_at, warp

# ------------------------------------------------------------------------------------------------------
# The code before the change (outrider 0517fed: core/sampling.py warp / sample_rows, plugins/acceptors),
# verbatim but for names: a full stable sort for top-p, every row warped and sampled.


def reference_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    x = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
    if params.greedy:
        idx = x.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    x = x / float(params.temperature)
    vocab = x.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else 0
    if k == 0 and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    if k:
        vals, idx = torch.topk(x, k, dim=-1, largest=True, sorted=True)
    else:
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        before = cum - probs
        keep = before < params.top_p
        keep[..., 0] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(x).scatter_(-1, idx, probs)


def reference_sample_rows(probs: torch.Tensor, us: list[float]) -> list[int]:
    p = probs.detach().to(torch.float64)
    cum = torch.cumsum(p, dim=-1)
    total = cum[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("cannot sample")
    u = torch.tensor(list(us), dtype=torch.float64, device=p.device).unsqueeze(-1)
    idx = torch.searchsorted(cum, u * total, right=True).squeeze(-1).tolist()
    for r, i in enumerate(idx):
        if i >= p.shape[-1]:
            idx[r] = int(torch.nonzero(p[r] > 0)[-1])
    return idx


def reference_greedy(target_logits, draft_tokens):
    k = len(draft_tokens)
    top = target_logits.argmax(dim=-1)
    if k:
        ok = top[:k] == torch.tensor(draft_tokens, dtype=top.dtype)
        bad = torch.cat([~ok, ok.new_ones(1)])
        n = int(bad.to(torch.uint8).argmax())
    else:
        n = 0
    return AcceptResult(tokens=list(draft_tokens[:n]) + [int(top[n])], accepted=n)


def reference_sampled(target_logits, draft_tokens, draft_probs, params, rng, position):
    if params.greedy:
        return reference_greedy(target_logits, draft_tokens)
    k = len(draft_tokens)
    p = reference_warp(target_logits, params)
    if draft_probs is None:
        t = reference_sample_rows(p, [rng.uniform(position + i) for i in range(k + 1)])
        n = next((i for i, x in enumerate(draft_tokens) if t[i] != x), k)
        return AcceptResult(tokens=list(draft_tokens[:n]) + [t[n]], accepted=n)
    n = k
    q = draft_probs.to(dtype=torch.float32)
    idx = torch.tensor(draft_tokens).unsqueeze(1)
    px, qx = p[:k].gather(1, idx).squeeze(1).tolist(), q.gather(1, idx).squeeze(1).tolist()
    for i in range(k):
        if not (qx[i] > 0.0 and rng.uniform_aux(position + i) * qx[i] <= px[i]):
            n = i
            break
    if n < k:
        residual = torch.clamp(p[n] - q[n], min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p[n]
        tok = reference_sample_rows(residual.reshape(1, -1), [rng.uniform(position + n)])[0]
    else:
        tok = reference_sample_rows(p[k].reshape(1, -1), [rng.uniform(position + k)])[0]
    return AcceptResult(tokens=list(draft_tokens[:n]) + [tok], accepted=n)


# ------------------------------------------------------------------------------------------------------


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
        res = accept(logits, drafts, q, params, rng, 100 + 8 * r)
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
    print("| vocabulary | acceptor, sampling | before ms/round | after ms/round | before / after | accepted/round |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for label, acceptor, params, with_q in cells:
            rounds = make_rounds(vocab, args.k, args.rounds, with_q, params)
            old_ms, new_ms = [], []
            for run in range(args.runs + 1):  # run 0 warms up
                t_old, out_old = per_round_ms(reference_sampled, rounds, params, seed=run)
                t_new, out_new = per_round_ms(acceptor.accept, rounds, params, seed=run)
                if out_old != out_new:
                    raise SystemExit(f"{label} at V={vocab}: the new code emitted {out_new}, the old {out_old}")
                if run:
                    old_ms.append(t_old)
                    new_ms.append(t_new)
            accepted = statistics.mean(a for _, a in out_new)
            before, after = statistics.median(old_ms), statistics.median(new_ms)
            print(f"| {vocab} | {label} | {before:.2f} | {after:.2f} | {before / after:.1f}x | {accepted:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
