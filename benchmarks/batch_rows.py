"""What does a target forward cost by the rows it reads, and where does a batched step's time go?

Three tables, on the CPU backend's compact kernels, medians of `--runs`:
1. one sequence, R rows verified at once (`Decoder.forward` over R tokens after a `--context`-token prompt), R = 1..32;
2. the same R rows as B sequences of R/B rows each (`Decoder.forward_sequences`, each over its own cache holding
   the prompt), so the ragged batch's price beside one sequence's;
3. `Runner.step` over B sequences (`--steps` rounds of `generate_many`, greedy): the share of its time in the
   target forward, the drafter, the acceptors and the rest, per drafter named in `--drafters`.

    python benchmarks/batch_rows.py --model qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, runs: int) -> float:
    """Median seconds of `runs` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def split(rows: int, seqs: int) -> list[int]:
    base, extra = divmod(rows, seqs)
    return [base + (i < extra) for i in range(seqs)]


def forward_costs(model, prompt: list[int], rows: list[int], seqs: list[int], runs: int) -> None:
    caches = []
    ids = torch.tensor(prompt)
    for _ in range(max(seqs)):
        cache = model.new_cache(len(prompt) + max(rows) + 8)
        model.forward(ids, 0, cache, last_only=True)
        caches.append(cache)
    n = len(prompt)
    drafts = torch.tensor((prompt * (1 + max(rows) // len(prompt)))[: max(rows)])

    def one(r: int):
        model.forward(drafts[:r], n, caches[0])
        caches[0].truncate(n)

    def ragged(r: int, b: int):
        counts = split(r, b)
        toks = torch.cat([drafts[:c] for c in counts])
        model.forward_sequences(toks, counts, [n] * b, caches[:b])
        for cache in caches[:b]:
            cache.truncate(n)

    base = timed(lambda: one(1), runs)
    print(f"\n1. one sequence, R rows after a {n}-token prompt")
    print(f"{'rows':>5} {'ms':>8} {'ms/row':>8} {'x 1 row':>8}")
    for r in rows:
        s = timed(lambda: one(r), runs)
        print(f"{r:>5} {s * 1e3:8.1f} {s * 1e3 / r:8.2f} {s / base:8.2f}")
    print("\n2. R rows as B sequences (forward_sequences), ms; in brackets: over one sequence's R rows")
    print(f"{'rows':>5} " + " ".join(f"{'B=' + str(b):>14}" for b in seqs))
    for r in rows:
        alone = timed(lambda: one(r), runs)
        cells = []
        for b in seqs:
            if b > r:
                cells.append(f"{'':>14}")
                continue
            s = timed(lambda: ragged(r, b), runs)
            cells.append(f"{s * 1e3:7.1f} ({s / alone:4.2f})")
        print(f"{r:>5} " + " ".join(cells))


class Clock:
    """Seconds spent inside each wrapped callable, and its calls; an `inner` one counts only inside `step` (the
    target's forward also reads prompts)."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stepping = False

    def wrap(self, name: str, fn, inner: bool = False):
        def timed_call(*a, **kw):
            if inner and not self.stepping:
                return fn(*a, **kw)
            outer = name == "step"
            self.stepping |= outer
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1
                if outer:
                    self.stepping = False
        return timed_call


def step_breakdown(target, drafter_name: str, prompts: list[list[int]], tokens: int, draft_path) -> None:
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.draft_model import DraftModelDrafter
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    drafter = {"none": NoDrafter, "lookup": LookupDrafter,
               "draft-model": lambda: DraftModelDrafter(model=str(draft_path))}[drafter_name]()
    if hasattr(drafter, "setup"):
        drafter.setup(target)
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=0 if drafter_name == "none" else "auto"), context=4096)
    params = [SamplingParams(temperature=0.0) for _ in prompts]
    runner.generate_many(prompts, 8, params)  # warm-up
    clock = Clock()
    model = target.model
    forward, forward_sequences, drafts, step = model.forward, model.forward_sequences, runner._drafts, runner.step
    model.forward = clock.wrap("target forward", forward, inner=True)
    model.forward_sequences = clock.wrap("target forward", forward_sequences, inner=True)
    runner._drafts = clock.wrap("drafter", drafts, inner=True)
    runner.step = clock.wrap("step", step)
    try:
        t = time.perf_counter()
        seqs = runner.generate_many(prompts, tokens, params)
        wall = time.perf_counter() - t
    finally:
        model.forward, model.forward_sequences, runner._drafts, runner.step = forward, forward_sequences, drafts, step
    made = sum(len(s.output) for s in seqs)
    steps = clock.calls.get("step", 1)
    stepped = clock.spent.get("step", 0.0)
    fwd, dr = clock.spent.get("target forward", 0.0), clock.spent.get("drafter", 0.0)
    prefill = wall - stepped
    print(f"{drafter_name:>12} B={len(prompts)}: {made / wall:6.1f} tok/s over {wall:5.1f} s "
          f"(prefill {prefill:4.1f} s); per step {stepped / steps * 1e3:6.1f} ms: forward {fwd / stepped:4.0%}, "
          f"drafter {dr / stepped:4.0%}, rest {(stepped - fwd - dr) / stepped:4.0%}; "
          f"{made / max(1, sum(s.stats.rounds for s in seqs)):4.2f} tokens a sequence-round")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens in each cache before the rows")
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    parser.add_argument("--sequences", default="1,2,4,8")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafters", default="none,lookup", help="step breakdown for these ('' to skip)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence generates in the breakdown")
    parser.add_argument("--skip-forward", action="store_true")
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import template_or_raw_ids
    from outrider.native import vector_extensions
    from outrider.plugins.drafters.mtp.prompts import CODE_PROMPTS
    from outrider.plugins.backends.cpu import CPUBackend
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.spec.drafter import Target

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    g = GGUFFile(path)
    backend = CPUBackend(threads=args.threads)
    target = Target(backend.load_model(g), Tokenizer.from_gguf(g), g, backend)
    print(f"{args.model} on {args.threads} threads; CPU: {' '.join(vector_extensions())}")
    text = " ".join(CODE_PROMPTS)
    prompt = target.tokenizer.encode(text)[: args.context]
    if not args.skip_forward:
        forward_costs(target.model, prompt, [int(r) for r in args.rows.split(",")],
                      [int(b) for b in args.sequences.split(",")], args.runs)
    if args.drafters:
        print(f"\n3. Runner.step over B sequences, {args.tokens} tokens each, greedy")
        prompts = [template_or_raw_ids(target.gguf, target.tokenizer, p)[0] for p in CODE_PROMPTS]
        draft_path = resolve_model(args.draft)
        for name in args.drafters.split(","):
            for b in [int(b) for b in args.sequences.split(",")]:
                step_breakdown(target, name, prompts[:b], args.tokens, draft_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
