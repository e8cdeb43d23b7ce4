"""Speculative decoding benchmark, side by side in one run: plain vs lookup vs draft-model, on an
echo-heavy prompt (the answer mostly copies the prompt) and an open-ended one, greedy and at
temperature 0.7, on both real models.

    python benchmarks/speculative.py [--models smollm2-135m gemma3-270m] [--tokens 96] [--runs 3]

Each cell is the median of --runs generations; ratios are to plain decoding measured in the same run.
The draft-model drafter needs a smaller model with the same vocabulary; none is on the package
registry for either family, so it drafts with a bfloat16 copy of the target (`--draft-model` to change).
"""

from __future__ import annotations

import argparse
import statistics

from outrider.assembly import assemble
from outrider.chat import apply_chat_template
from outrider.config import resolve_config

ECHO_PROMPT = ("Fix the spelling mistakes in this paragraph and write the whole corrected paragraph:\n\n"
               "The meeting is on Monday at 10 am in room 204. Please bring your laptop, your notes from last "
               "weak, and the quarterly report. We will discus the budget for the next year, the new hiring "
               "plan, and the schedule for the office move. If you can not attend, send your comments to "
               "the team before Friday so that we can include them in the minutes.")
OPEN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = {"echo": ECHO_PROMPT, "open": OPEN_PROMPT}


def build(model: str, drafter: str, temperature: float, tokens: int, draft_model: str | None, draft_max):
    flags = {"model": model, "drafter": drafter, "temperature": temperature, "seed": 1, "max_tokens": tokens,
             "chat": True, "draft_max": draft_max, "draft_model": draft_model or model}
    # with no smaller model of the family, a bfloat16 copy of the target drafts for the float32 target
    options = [("drafter.dtype", "bfloat16")] if drafter == "draft-model" and draft_model is None else []
    return assemble(resolve_config(flags, None, {}, options))


def prompt_ids(assembly, prompt: str) -> list[int]:
    text = apply_chat_template(assembly.gguf, assembly.tokenizer, [{"role": "user", "content": prompt}])
    return assembly.tokenizer.encode(text, add_bos=False)


def measure_interleaved(assemblies: dict, prompt: str, tokens: int, runs: int) -> dict[str, dict]:
    """Runs every configuration once per round, `runs` rounds after a warm-up round, so that slow drifts of
    a shared machine hit all configurations alike; medians per configuration."""
    results: dict[str, list[dict]] = {name: [] for name in assemblies}
    for round_index in range(runs + 1):
        for name, assembly in assemblies.items():
            list(assembly.runner.generate(prompt_ids(assembly, prompt), tokens, assembly.params, frozenset()))
            if round_index:
                results[name].append(assembly.runner.stats.as_dict())
    keys = ("decode_tokens_per_s", "acceptance_rate", "mean_acceptance_length")
    return {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--draft-max", default="auto")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--drafters", nargs="+", default=["none", "lookup", "draft-model"])
    args = parser.parse_args()

    print(f"{args.tokens} new tokens (EOS ignored), median of {args.runs} runs, draft_max {args.draft_max}\n")
    print("| model | prompt | T | drafter | decode tok/s | ratio to plain | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for temperature in (0.0, 0.7):
            assemblies = {d: build(model, d, temperature, args.tokens, args.draft_model, args.draft_max)
                          for d in args.drafters}
            for prompt_name, prompt in PROMPTS.items():
                results = measure_interleaved(assemblies, prompt, args.tokens, args.runs)
                plain = results.get("none", {}).get("decode_tokens_per_s")
                for drafter, r in results.items():
                    ratio = r["decode_tokens_per_s"] / plain if plain else float("nan")
                    print(f"| {model} | {prompt_name} | {temperature} | {drafter} | {r['decode_tokens_per_s']:.1f} | "
                          f"{ratio:.2f}x | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
