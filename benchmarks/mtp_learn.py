"""Does `-o drafter.learn true` pay? A distilled head drafting for 20 consecutive requests on one code base, learning
as it goes, beside the same head frozen and plain decoding, in one run.

The code base is Outrider's own source, which no head has seen: request i asks the target (Qwen2.5-Coder-1.5B)
to add a docstring and type hints to the i-th function of `FILES` (chat template, greedy, at most --tokens new
tokens). Each request runs plain, with the frozen head (`--drafter mtp`) and with a learning copy of it
(`-o drafter.learn true`; a copy, so the cached head stays as distill left it), in that order. Printed per
request: first-position acceptance and decode tok/s of both heads, and plain's; then the three held-out
prompts of benchmarks/mtp_heads.py once more with each head.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--head", help="the distilled head [the one `outrider distill` cached for the target]")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", default="auto")
    parser.add_argument("--learn-share", type=float, default=0.2)
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import template_or_raw_ids
    from outrider.native import cflags, vector_extensions
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.mtp.prompts import HELD_OUT_PROMPTS
    from outrider.plugins.drafters.mtp.drafter import MTPDrafter, mtp_sidecar_path
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    target_path = resolve_model(args.target)
    head = Path(args.head) if args.head else mtp_sidecar_path(target_path)
    if not head.is_file():
        sys.exit(f"no MTP head at {head}: run `outrider distill {args.target}` first, or pass --head")
    work = Path(tempfile.mkdtemp(prefix="mtp-learn-"))
    learning_copy = work / head.name
    shutil.copy2(head, learning_copy)

    target = cpu_target(target_path, args.threads)
    g = target.gguf
    frozen = MTPDrafter(model=str(head))
    learning = MTPDrafter(model=str(learning_copy), learn=True, learn_share=args.learn_share)
    frozen.setup(target)
    learning.setup(target)
    runners = {name: Runner(target, d, GreedyAcceptor(), DrafterTraits.of(d, draft_max=0 if name == "plain" else
                                                                         args.draft_max), context=4096)
               for name, d in (("plain", NoDrafter()), ("frozen", frozen), ("learning", learning))}
    encode = lambda text: template_or_raw_ids(g, target.tokenizer, text)[0]

    def run(name: str, ids: list[int]) -> tuple[float, float]:
        runner = runners[name]
        list(runner.generate(ids, args.tokens, SamplingParams(), stop_ids=target.tokenizer.eog_ids))
        s = runner.stats
        first = s.accepted_at[0] / s.drafted_at[0] if s.drafted_at else float("nan")
        return s.generated_tokens / s.decode_s, first

    print(f"CPU vector extensions: {' '.join(vector_extensions())}; Outrider's kernels built with {' '.join(cflags())}; "
          f"{args.threads} threads; greedy; {args.tokens} tokens; draft-max {args.draft_max}; learn share "
          f"{args.learn_share}; head {head.name}\n")
    print("| request | plain tok/s | frozen tok/s | frozen accepted@1 | learning tok/s | learning accepted@1 | "
          "learning steps |")
    print("|---|---|---|---|---|---|---|")
    run("plain", encode("Say hello."))  # warm-up
    rows = []
    for i, src in enumerate(functions(args.requests)):
        ids = encode(f"Add a docstring and type hints to this Python function and return the whole function:\n\n"
                     f"```python\n{src}\n```")
        plain, _ = run("plain", ids)
        frozen_speed, frozen_first = run("frozen", ids)
        learning_speed, learning_first = run("learning", ids)
        rows.append((plain, frozen_speed, frozen_first, learning_speed, learning_first))
        print(f"| {i + 1} | {plain:.1f} | {frozen_speed:.1f} | {frozen_first:.2f} | {learning_speed:.1f} | "
              f"{learning_first:.2f} | {learning.learner.steps} |", flush=True)
    half = len(rows) // 2
    for label, part in (("first half", rows[:half]), ("second half", rows[half:])):
        med = lambda j: statistics.median(r[j] for r in part)
        print(f"\n{label}: accepted@1 frozen {med(2):.2f}, learning {med(4):.2f}; speed-up over plain frozen "
              f"{statistics.median(r[1] / r[0] for r in part):.2f}x, learning "
              f"{statistics.median(r[3] / r[0] for r in part):.2f}x")
    learning.learner.save()
    print("\nheld-out code after the requests (the learned head saved and reloaded):")
    reloaded = MTPDrafter(model=str(learning_copy))
    reloaded.setup(target)
    runners["learned"] = Runner(target, reloaded, GreedyAcceptor(), DrafterTraits.of(reloaded, draft_max=args.draft_max),
                                context=4096)
    print("| prompt | plain tok/s | frozen | learned |\n|---|---|---|---|")
    for i, text in enumerate(HELD_OUT_PROMPTS):
        ids = encode(text)
        plain, _ = run("plain", ids)
        f_speed, f_first = run("frozen", ids)
        l_speed, l_first = run("learned", ids)
        print(f"| held-out code {i + 1} | {plain:.1f} | {f_speed / plain:.2f}x ({f_first:.2f}) | "
              f"{l_speed / plain:.2f}x ({l_first:.2f}) |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
