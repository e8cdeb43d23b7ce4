"""How the idle learner's settings trade adaptation against forgetting, measured on recorded rows, in minutes.

`benchmarks/mtp_learn.py` measures the learner as a server runs it, but every setting costs it the target's
decoding of 20 requests four times. The learner itself needs only the rows a request left (tokens, the target's
hidden states), and the head's first draft at T=0 is accepted exactly where its argmax is the target's next
greedy token. So this records the rows once (the same 20 requests as mtp_learn.py, and the three held-out prompts,
greedy, the target's own continuation), then replays the server's life for each setting: per request, the head's
first-position acceptance on the request's answer rows (as it drafts them, before it learns from them), then the
idle work on the request's rows (`HeadLearner.idle` until done). After the last request, the learned head's
acceptance on the held-out prompts' answers and its agreement with the target on standard-library passages (the
kind of text distill trained on; other passages), against the distilled head's: adaptation is the first,
forgetting the other two. And the learning curve on the code base: after every fifth request, the head's
first-position acceptance on `--probe` more functions of the code base (those after the requests', which may
be in other files), which it never learns from: the same rows each time, so the curve is the head's change,
not the requests' differences. The learned head is measured as it drafts: its weights rounded to the form the
learner rebuilds it in (`HeadLearner.matrices`).

    python benchmarks/mtp_learn_rows.py --threads 2 --head ~/.cache/outrider/exp-120e/....mtp.gguf \\
        --setting anchor=0 --setting anchor=0.03
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from mtp_learn import distilled_head, functions, request_arguments  # noqa: E402
from qwen_pair import cpu_target  # noqa: E402

REQUEST = "Add a docstring and type hints to this Python function and return the whole function:\n\n```python\n{}\n```"


def record(target, n_requests: int, tokens: int, n_probe: int = 0, recorded: list | None = None) -> dict:
    """{"requests": [...], "held_out": [...], "probe": [...]}, each (tokens, hidden rows [len - 1, H] float16,
    prompt length); the probe: the `n_probe` functions after the requests'. `recorded`: requests recorded
    earlier, from sources that may have changed since: the probe alone, of functions whose name (`def name(`)
    none of them shows, so that a function edited since is not taken for a new one."""
    from outrider.io.chat import template_or_raw_ids
    from outrider.plugins.drafters.mtp.distill import generate
    from outrider.plugins.drafters.mtp.prompts import HELD_OUT_PROMPTS

    def one(text: str):
        ids = template_or_raw_ids(target.gguf, target.tokenizer, text)[0]
        outs, hidden = generate(target.model, [ids], tokens, [0.0], torch.Generator(), set(target.tokenizer.eog_ids),
                                hidden=True)
        return ids + outs[0], hidden[0], len(ids)

    if recorded is not None:
        asked = [target.tokenizer.decode(tokens[:prompt]) for tokens, _, prompt in recorded]
        fresh = [src for src in functions(len(recorded) + n_probe + 20)[len(recorded):]
                 if not any(src.split("(")[0] + "(" in text for text in asked)]
        return {"probe": [one(REQUEST.format(src)) for src in fresh[:n_probe]]}
    sources = functions(n_requests + n_probe)
    return {"requests": [one(REQUEST.format(src)) for src in sources[:n_requests]],
            "held_out": [one(text) for text in HELD_OUT_PROMPTS],
            "probe": [one(REQUEST.format(src)) for src in sources[n_requests:]]}


@torch.inference_mode()
def record_passages(target, n: int, chars: int) -> list:
    """Passages of the standard library (the text distill trains on, other passages of it), each (tokens, the
    target's hidden rows, 1): what the head knew of code in general, read in one prefill each."""
    import random

    from outrider.plugins.drafters.mtp.distill import stdlib_texts

    out = []
    for text in stdlib_texts(n, random.Random(12345), chars):
        ids = target.tokenizer.encode(text)
        _, hidden = target.model.forward(torch.tensor(ids), 0, target.model.new_cache(len(ids)), hidden=True,
                                         last_only=True)
        out.append((ids, hidden[:-1].half(), 1))
    return out


@torch.no_grad()
def first_acceptance(head, tokens: list[int], hidden: torch.Tensor, prompt: int, target_rows=None) -> float:
    """The share of answer positions where the head's first draft (argmax) is the target's greedy next token:
    the next token of a greedy answer, or (`target_rows`, on a passage the target read) the target's argmax
    within the draft vocabulary, from its hidden state there."""
    from outrider.plugins.drafters.mtp.head import target_logits

    h = hidden.float()
    h_prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    n = hidden.shape[0]  # rows 0..n-1; row p drafts x_{p+1} = tokens[p + 1]
    logits, _ = head(torch.tensor(tokens[:n]), h_prev)
    drafted = head.vocab_ids[logits.argmax(-1)]
    if target_rows is None:
        want = torch.tensor(tokens[1:n + 1])
    else:
        want = head.vocab_ids[target_logits(h, target_rows, head.softcap).argmax(-1)]
    answer = slice(prompt, n)  # rows that draft the answer's second token on: the first comes from the prefill
    return float((drafted[answer] == want[answer]).float().mean())


def parse_setting(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        out[key] = float(value) if key != "rows" else int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    request_arguments(parser)
    parser.add_argument("--rows-file", type=Path, help="record here once, then read [record in memory]")
    parser.add_argument("--passages", type=int, default=8, help="standard-library passages held out")
    parser.add_argument("--passage-chars", type=int, default=2000)
    parser.add_argument("--probe", type=int, default=6, help="functions of the code base held out for the curve")
    parser.add_argument("--setting", action="append", default=[],
                        help="LearnSettings fields, key=value,...: lr, anchor, rows, feature_weight")
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.gguf import GGUFFile
    from outrider.native import vector_extensions
    from outrider.plugins.drafters.mtp.head import TrainableHead
    from outrider.plugins.drafters.mtp.learn import HeadLearner, LearnSettings

    torch.set_num_threads(args.threads)
    target_path = resolve_model(args.target)
    head_path = distilled_head(args.head, target_path)
    target = cpu_target(target_path, args.threads)
    if args.rows_file and args.rows_file.is_file():
        rows = torch.load(args.rows_file)
    else:
        t0 = time.perf_counter()
        rows = record(target, args.requests, args.tokens, args.probe)
        print(f"recorded {len(rows['requests'])} requests and {len(rows['held_out'])} held-out prompts in "
              f"{time.perf_counter() - t0:.0f} s")
        if args.rows_file:
            torch.save(rows, args.rows_file)
    if len(rows.get("probe", ())) != args.probe:
        rows.update(record(target, len(rows["requests"]), args.tokens, args.probe, recorded=rows["requests"]))
        if args.rows_file:
            torch.save(rows, args.rows_file)
    if "passages" not in rows:
        rows["passages"] = record_passages(target, args.passages, args.passage_chars)
        if args.rows_file:
            torch.save(rows, args.rows_file)
    model, g = target.model, target.gguf
    frozen = TrainableHead.from_sidecar(model, g, GGUFFile(head_path))
    base = [first_acceptance(frozen, *r) for r in rows["requests"]]
    held = [first_acceptance(frozen, *r) for r in rows["held_out"]]
    target_rows = model.output.rows(frozen.vocab_ids).float()
    general = lambda head: statistics.mean(first_acceptance(head, *r, target_rows) for r in rows["passages"])
    passages = general(frozen)
    on_probe = lambda head: statistics.mean(first_acceptance(head, *r) for r in rows["probe"])
    curve_at = list(range(0, len(base) + 1, 5))
    print(f"CPU vector extensions: {' '.join(vector_extensions())}; {args.threads} threads; head {head_path.name}")
    half = len(base) // 2
    print(f"frozen head: accepted@1 on the requests, mean of each half {statistics.mean(base[:half]):.3f} / "
          f"{statistics.mean(base[half:]):.3f}; held-out {' / '.join(f'{a:.3f}' for a in held)}; agreement with "
          f"the target on {len(rows['passages'])} standard-library passages {passages:.3f}; on the probe functions "
          f"{on_probe(frozen):.3f}\n")
    print(f"| setting | gain@1 requests 1-10 | gain@1 requests 11-20 | held-out change | passages change | steps | "
          f"idle s | accepted@1 on {len(rows['probe'])} probe functions after {', '.join(map(str, curve_at))} "
          "requests |")
    print("|---|---|---|---|---|---|---|---|")
    work = Path(tempfile.mkdtemp(prefix="mtp-learn-rows-"))
    for text in args.setting or [""]:
        copy = work / head_path.name
        shutil.copy2(head_path, copy)
        learner = HeadLearner(model, g, GGUFFile(copy), LearnSettings(**parse_setting(text)))
        # what drafts: the trained weights rounded to the learner's form
        drafting = lambda: TrainableHead.from_sidecar(model, g, learner.drafting_tensors())  # noqa: E731
        gains, curve, seconds = [], [on_probe(drafting())], 0.0
        for i, ((tokens, hidden, prompt), before) in enumerate(zip(rows["requests"], base), start=1):
            gains.append(first_acceptance(drafting(), tokens, hidden, prompt) - before)
            t0 = time.perf_counter()
            learner.begin()
            while learner.idle(tokens, hidden, hidden.shape[0])[0]:
                pass
            seconds += time.perf_counter() - t0
            if i in curve_at:
                curve.append(on_probe(drafting()))
        learned = drafting()
        after = [first_acceptance(learned, *r) - a for r, a in zip(rows["held_out"], held)]
        print(f"| {text or 'default'} | {statistics.mean(gains[:half]):+.3f} | {statistics.mean(gains[half:]):+.3f} | "
              f"{' / '.join(f'{a:+.3f}' for a in after)} | {general(learned) - passages:+.3f} | {learner.steps} | "
              f"{seconds:.0f} | {' '.join(f'{a:.3f}' for a in curve)} |", flush=True)
        learner.unsaved = False
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
