"""Does `-o drafter.learn true` pay? A distilled head drafting for 20 consecutive requests on one code base, learning
as it goes, beside the same head frozen and plain decoding, in one run.

The code base is Outrider's own source, which no head has seen: request i asks the target (Qwen2.5-Coder-1.5B)
to add a docstring and type hints to the i-th function of `FILES` (chat template, greedy, at most --tokens new
tokens). Each request runs plain, with the frozen head (`--drafter mtp`) and with two learning copies of it (copies,
so the cached head stays as distill left it): "in requests" trains during each request with `learn_share`
(--learn-share), as a one-shot generation does (or, `--other unanchored`, an idle learner without the anchor);
"idle" is the server's way, the default settings, its training done between requests (`Runner.idle` until no work
is left, as the server's worker calls it while no request waits; timed apart). Printed per request:
first-position acceptance and decode tok/s of each; then the three held-out prompts of benchmarks/mtp_heads.py
once more with each head, frozen.

    python benchmarks/mtp_learn.py --threads 2
"""

from __future__ import annotations

import argparse
import ast
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from qwen_pair import cpu_target  # noqa: E402
FILES = ("core/spec/runner.py", "core/spec/chain.py", "core/spec/length_policy.py", "core/spec/penalties.py",
         "core/io/chat.py", "core/catalog.py", "core/serve/app.py")


def functions(n: int, lines: tuple[int, int] = (6, 40)) -> list[str]:
    """The first `n` functions (methods too) of FILES whose source has lines[0]..lines[1] lines, in file order."""
    out = []
    for name in FILES:
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_text()
        for node in sorted(ast.walk(ast.parse(text)), key=lambda node: getattr(node, "lineno", 0)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                src = ast.get_source_segment(text, node)
                src = src and textwrap.dedent(" " * node.col_offset + src)  # a method's first line keeps its indent
                if src and lines[0] <= src.count("\n") + 1 <= lines[1]:
                    out.append(src)
    return out[:n]


def request_arguments(parser: argparse.ArgumentParser) -> None:
    """The target, its head, the requests and the threads (mtp_learn_rows.py replays the same requests)."""
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--head", help="the distilled head [the one `outrider distill` cached for the target]")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)


def distilled_head(head: str | None, target_path: Path) -> Path:
    """`head`, else the one distill cached for the target; where a learned head replaced it, distill's own."""
    from outrider.plugins.drafters.mtp.drafter import mtp_sidecar_path

    path = Path(head) if head else mtp_sidecar_path(target_path)
    return path.with_suffix(".distilled.gguf") if path.with_suffix(".distilled.gguf").is_file() else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    request_arguments(parser)
    parser.add_argument("--draft-max", default="auto")
    parser.add_argument("--learn-share", type=float, default=0.2, help="the in-request learner's share")
    parser.add_argument("--other", choices=("in requests", "unanchored"), default="in requests",
                        help="the learner beside the idle one: learning in requests, or idle without the anchor")
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import template_or_raw_ids
    from outrider.native import cflags, vector_extensions
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.mtp.prompts import HELD_OUT_PROMPTS
    from outrider.plugins.drafters.mtp.drafter import MTPDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    target_path = resolve_model(args.target)
    head = distilled_head(args.head, target_path)
    if not head.is_file():
        sys.exit(f"no MTP head at {head}: run `outrider distill {args.target}` first, or pass --head")
    work = Path(tempfile.mkdtemp(prefix="mtp-learn-"))

    target = cpu_target(target_path, args.threads)
    g = target.gguf
    other = args.other
    learners = {other: dict(learn_share=args.learn_share) if other == "in requests" else
                dict(learn_anchor=0.0), "idle": {}}
    copies = {}
    for name in learners:
        copies[name] = work / name.replace(" ", "-") / head.name
        copies[name].parent.mkdir()
        shutil.copy2(head, copies[name])
    drafters = {"plain": NoDrafter(), "frozen": MTPDrafter(model=str(head))}
    drafters.update({name: MTPDrafter(model=str(copies[name]), learn=True, **options)
                     for name, options in learners.items()})
    for d in drafters.values():
        d.setup(target)
    runners = {name: Runner(target, d, GreedyAcceptor(), DrafterTraits.of(d, draft_max=0 if name == "plain" else
                                                                         args.draft_max), context=4096)
               for name, d in drafters.items()}
    encode = lambda text: template_or_raw_ids(g, target.tokenizer, text)[0]

    def run(name: str, ids: list[int]) -> tuple[float, float]:
        runner = runners[name]
        list(runner.generate(ids, args.tokens, SamplingParams(), stop_ids=target.tokenizer.eog_ids))
        s = runner.stats
        first = s.accepted_at[0] / s.drafted_at[0] if s.drafted_at else float("nan")
        return s.generated_tokens / s.decode_s, first

    def idle_time(name: str) -> float:
        t0 = time.perf_counter()
        while runners[name].idle():
            pass
        return time.perf_counter() - t0

    print(f"CPU vector extensions: {' '.join(vector_extensions())}; Outrider's kernels built with {' '.join(cflags())}; "
          f"{args.threads} threads; greedy; {args.tokens} tokens; draft-max {args.draft_max}; "
          + (f"in-request learn share {args.learn_share}; " if other == "in requests" else "") + f"head {head.name}\n")
    print(f"| request | plain tok/s | frozen tok/s (accepted@1) | {other} tok/s (accepted@1), steps | idle tok/s "
          "(accepted@1), steps | idle training s |")
    print("|---|---|---|---|---|---|")
    run("plain", encode("Say hello."))  # warm-up
    for name in learners:  # a server's worker offers idle time before its first request: no learning in requests
        if name != "in requests":
            idle_time(name)
    rows = []
    for i, src in enumerate(functions(args.requests)):
        ids = encode(f"Add a docstring and type hints to this Python function and return the whole function:\n\n"
                     f"```python\n{src}\n```")
        plain, _ = run("plain", ids)
        frozen = run("frozen", ids)
        beside = run(other, ids)
        idle = run("idle", ids)
        if other != "in requests":
            idle_time(other)
        idle_s = idle_time("idle")
        rows.append((plain, *frozen, *beside, *idle))
        steps = lambda name: drafters[name].learner.steps
        print(f"| {i + 1} | {plain:.1f} | {frozen[0]:.1f} ({frozen[1]:.2f}) | {beside[0]:.1f} "
              f"({beside[1]:.2f}), {steps(other)} | {idle[0]:.1f} ({idle[1]:.2f}), {steps('idle')} | "
              f"{idle_s:.1f} |", flush=True)
    half = len(rows) // 2
    for label, part in (("first half", rows[:half]), ("second half", rows[half:])):
        if not part:  # one request: no first half
            continue
        med = lambda j: statistics.median(r[j] for r in part)
        ratio = lambda j: statistics.median(r[j] / r[0] for r in part)
        gap = lambda j: statistics.median(r[j] - r[2] for r in part)
        print(f"\n{label}: accepted@1 frozen {med(2):.2f}, {other} {med(4):.2f} ({gap(4):+.2f} on frozen, median "
              f"per request), idle {med(6):.2f} ({gap(6):+.2f}); speed-up over plain: frozen {ratio(1):.2f}x, "
              f"{other} {ratio(3):.2f}x, idle {ratio(5):.2f}x")
    print("\nheld-out code after the requests (each learned head saved and reloaded, frozen):")
    for name in learners:
        drafters[name].learner.save()
        reloaded = MTPDrafter(model=str(copies[name]))
        reloaded.setup(target)
        runners[f"learned {name}"] = Runner(target, reloaded, GreedyAcceptor(),
                                            DrafterTraits.of(reloaded, draft_max=args.draft_max), context=4096)
    print(f"| prompt | plain tok/s | frozen | learned {other} | learned idle |\n|---|---|---|---|---|")
    for i, text in enumerate(HELD_OUT_PROMPTS):
        ids = encode(text)
        plain, _ = run("plain", ids)
        cells = [run(name, ids) for name in ("frozen", f"learned {other}", "learned idle")]
        print(f"| held-out code {i + 1} | {plain:.1f} | " +
              " | ".join(f"{speed / plain:.2f}x ({first:.2f})" for speed, first in cells) + " |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
