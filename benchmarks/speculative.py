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
from outrider.config import resolve_config

ECHO_PROMPT = """Here is a Python function:

def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result

Rewrite it exactly, but rename `values` to `samples`. Output only the code.
"""
OPEN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = {"echo": ECHO_PROMPT, "open": OPEN_PROMPT}


def measure(model: str, drafter: str, prompt: str, temperature: float, tokens: int, runs: int,
            draft_model: str | None, draft_max: int) -> dict:
    flags = {"model": model, "drafter": drafter, "temperature": temperature, "seed": 1, "max_tokens": tokens,
             "chat": True, "draft_max": draft_max, "draft_model": draft_model or model}
    # with no smaller model of the family, a bfloat16 copy of the target drafts for the float32 target
    options = [("drafter.dtype", "bfloat16")] if drafter == "draft-model" and draft_model is None else []
    assembly = assemble(resolve_config(flags, None, {}, options))
    tokenizer = assembly.tokenizer
    from outrider.chat import apply_chat_template

    text = apply_chat_template(assembly.gguf, tokenizer, [{"role": "user", "content": prompt}])
    ids = tokenizer.encode(text, add_bos=False)
    results = []
    for _ in range(runs + 1):  # the first run warms up and is dropped
        list(assembly.runner.generate(ids, tokens, assembly.params, frozenset()))
        results.append(assembly.runner.stats.as_dict())
    results = results[1:]
    return {
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in results),
        "acceptance_rate": statistics.median(r["acceptance_rate"] for r in results),
        "mean_acceptance_length": statistics.median(r["mean_acceptance_length"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--drafters", nargs="+", default=["none", "lookup", "draft-model"])
    args = parser.parse_args()

    print(f"{args.tokens} new tokens (EOS ignored), median of {args.runs} runs, draft_max {args.draft_max}\n")
    print("| model | prompt | T | drafter | decode tok/s | ratio to plain | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for prompt_name, prompt in PROMPTS.items():
            for temperature in (0.0, 0.7):
                plain = None
                for drafter in args.drafters:
                    r = measure(model, drafter, prompt, temperature, args.tokens, args.runs, args.draft_model,
                                args.draft_max)
                    if drafter == "none":
                        plain = r["decode_tokens_per_s"]
                    ratio = r["decode_tokens_per_s"] / plain if plain else float("nan")
                    print(f"| {model} | {prompt_name} | {temperature} | {drafter} | {r['decode_tokens_per_s']:.1f} | "
                          f"{ratio:.2f}x | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
