"""What does a target forward cost by the rows it reads, and where does a batched step's time go?

Three tables, on the CPU backend's compact kernels, medians of `--runs`:
1. one sequence, R rows verified at once after a `--context`-token prompt, R = 1..32 (`outrider.bench.forward_seconds`);
2. the same R rows as B sequences of R/B rows each, each over its own cache holding the prompt (`outrider.bench.
   ragged_forward_seconds`, `Decoder.forward_sequences`), so the ragged batch's price beside one sequence's;
3. `Runner.step` over B sequences (`generate_many`'s calls, greedy, `--tokens` each): the share of a step's time in
   the target forward, the drafter and the rest (acceptors, bookkeeping), per drafter named in `--drafters`.

    python benchmarks/batch_rows.py --model qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from outrider.bench import forward_seconds, ragged_forward_seconds


def forward_costs(model, rows: list[int], seqs: list[int], prompt_len: int, runs: int) -> None:
    alone = forward_seconds(model, rows, prompt_len, runs)
    print(f"\n1. one sequence, R rows after a {prompt_len}-token prompt")
    print(f"{'rows':>5} {'ms':>8} {'ms/row':>8} {'x 1 row':>8}")
    for r in rows:
        print(f"{r:>5} {alone[r] * 1e3:8.1f} {alone[r] * 1e3 / r:8.2f} {alone[r] / alone[rows[0]]:8.2f}")
    ragged = ragged_forward_seconds(model, rows, seqs, prompt_len, runs)
    print("\n2. R rows as B sequences (forward_sequences), ms; in brackets: over one sequence's R rows")
    print(f"{'rows':>5} " + " ".join(f"{'B=' + str(b):>14}" for b in seqs))
    for r in rows:
        cells = [f"{ragged[r, b] * 1e3:7.1f} ({ragged[r, b] / alone[r]:4.2f})" if (r, b) in ragged else " " * 14
                 for b in seqs]
        print(f"{r:>5} " + " ".join(cells))


class Clock:
    """Seconds spent inside each wrapped callable."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed_call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
        return timed_call


def step_breakdown(target, drafter_name: str, prompts: list[list[int]], tokens: int, draft_name: str) -> None:
    """`generate_many`'s own calls, its prefills timed apart from its steps, and inside the steps the target's
    forward and the drafting (wrapped only once the prompts are read)."""
    from outrider.catalog import resolve_model
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.draft_model import DraftModelDrafter
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    drafter = {"none": NoDrafter, "lookup": LookupDrafter,
               "draft-model": lambda: DraftModelDrafter(model=str(resolve_model(draft_name)))}[drafter_name]()
    drafter.setup(target)
    traits = DrafterTraits.of(drafter, draft_max=0 if drafter_name == "none" else "auto")
    runner = Runner(target, drafter, GreedyAcceptor(), traits, context=4096)
    params = SamplingParams(temperature=0.0)
    runner.generate_many(prompts, 8, [params] * len(prompts))  # warm-up
    t = time.perf_counter()
    seqs = [runner.start(prompt, tokens, params)[0] for prompt in prompts]
    prefill = time.perf_counter() - t
    clock, model = Clock(), target.model
    forward, forward_sequences, drafts = model.forward, model.forward_sequences, runner._drafts
    model.forward = clock.wrap("forward", forward)
    model.forward_sequences = clock.wrap("forward", forward_sequences)
    runner._drafts = clock.wrap("drafter", drafts)
    steps, t = 0, time.perf_counter()
    try:
        while running := [s for s in seqs if not s.done]:
            runner.step(running)
            steps += 1
    finally:
        model.forward, model.forward_sequences, runner._drafts = forward, forward_sequences, drafts
        for seq in seqs:
            runner.finish(seq)
    stepped = time.perf_counter() - t
    made = sum(len(s.output) for s in seqs)
    fwd, dr = clock.spent.get("forward", 0.0), clock.spent.get("drafter", 0.0)
    print(f"{drafter_name:>12} B={len(prompts)}: {made / (prefill + stepped):6.1f} tok/s over {prefill + stepped:5.1f} s "
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
    from outrider.testing.fixtures import cpu_target

    torch.set_num_threads(args.threads)  # the CPU backend keeps torch's count
    target = cpu_target(resolve_model(args.model))
    print(f"{args.model} on {args.threads} threads; CPU: {' '.join(vector_extensions())}")
    sequences = [int(b) for b in args.sequences.split(",")]
    if not args.skip_forward:
        forward_costs(target.model, [int(r) for r in args.rows.split(",")], sequences, args.context, args.runs)
    if args.drafters:
        print(f"\n3. Runner.step over B sequences, {args.tokens} tokens each, greedy")
        prompts = [template_or_raw_ids(target.gguf, target.tokenizer, p)[0] for p in CODE_PROMPTS]
        for name in args.drafters.split(","):
            for b in sequences:
                step_breakdown(target, name, prompts[:b], args.tokens, args.draft)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
