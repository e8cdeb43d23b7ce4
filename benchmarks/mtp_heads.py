"""Does a distilled MTP head pay? `--drafter mtp` and `lookup,mtp` beside plain decoding on held-out code, in one run.

The target is the catalog's Qwen2.5-Coder-1.5B (Q4_K_M); the head is the one `outrider distill` cached for it
(or `--head`). The prompts are the three code-generation prompts distill never trains on
(`prompts.HELD_OUT_PROMPTS`) and qwen_pair's code edit (where lookup has text to copy), each through the file's
chat template. Every configuration runs at T=0 (greedy acceptor) and at T=0.7 (no other warper; the
sampled acceptor with the head's q), the same seed per round for every configuration; a warm-up round first.
llama-server is the peer in the same run (`--engines`): its plain decode and its speculative configurations
(`--llama-configs=...`, qwen_pair's: n-gram lookup, the 0.5B draft model), one server per configuration, all
started before the first round and idle while another engine decodes. Every round runs each prompt and T
through every configuration of both engines in turn, so a machine that drifts over the run moves both engines
alike. Printed: decode tok/s (medians), the speed-up over plain as the median of each round's ratio, each
Outrider row's speed over the best llama.cpp configuration on that prompt and T, as a median of per-round
ratios too (the best chosen by median tok/s); and acceptance per draft position j:
rounds that accepted position j / rounds that drafted at least j tokens, pooled over the measured rounds
(cumulative: accepting position 2 means position 1 was accepted too). `--other-head` adds a second head's
mtp as one more configuration (two heads compared side by side).

    python benchmarks/mtp_heads.py --threads 2 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_pair import PROMPTS as PAIR_PROMPTS  # noqa: E402
from qwen_pair import LLAMA_CONFIGS, LlamaServer, cpu_target, llama_server_binary  # noqa: E402

CONFIGS = ("none", "mtp", "lookup,mtp")
OTHER_HEAD = "mtp, other head"  # --other-head's configuration


def outrider_runners(target_path: Path, head: Path, temperatures: list[float], threads: int, draft_max: str,
                     other_head: Path | None = None) -> tuple:
    """(target, {(T, config): Runner}) for every configuration at every temperature."""
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.acceptors.sampled import SampledAcceptor
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.plugins.drafters.mtp.drafter import MTPDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.chain import DrafterChain
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner

    target = cpu_target(target_path, threads)
    mtp, lookup = MTPDrafter(model=str(head), sample=True), LookupDrafter()
    mtp.setup(target)
    lookup.setup(target)
    drafters = {"none": NoDrafter(), "mtp": mtp, "lookup,mtp": DrafterChain([lookup, mtp], ["lookup", "mtp"])}
    if other_head is not None:
        drafters[OTHER_HEAD] = MTPDrafter(model=str(other_head), sample=True)
        drafters[OTHER_HEAD].setup(target)
    return target, {(t, name): Runner(target, drafter, (SampledAcceptor if t > 0 else GreedyAcceptor)(),
                                      DrafterTraits.of(drafter, draft_max=0 if name == "none" else draft_max),
                                      context=4096)
                    for t in temperatures for name, drafter in drafters.items()}


def outrider_round(target, runner, ids: list[int], tokens: int, t: float, seed: int) -> tuple:
    """(tok/s, generated, drafted_at, accepted_at) of one generation."""
    from outrider.spec.sampling import SamplingParams

    params = SamplingParams(t, seed=seed) if t > 0 else SamplingParams()
    list(runner.generate(ids, tokens, params, stop_ids=target.tokenizer.eog_ids))
    s = runner.stats
    return s.generated_tokens / s.decode_s, s.generated_tokens, list(s.drafted_at), list(s.accepted_at)


def round_ratio(rows: list[tuple], base: list[tuple]) -> float:
    """The median over rounds of one configuration's tok/s over another's in the same round."""
    return statistics.median(r[0] / b[0] for r, b in zip(rows, base))


def per_position(rows: list[tuple]) -> list[float]:
    drafted, accepted = [], []
    for _, _, d, a in rows:
        for j, (dj, aj) in enumerate(zip(d, a)):
            if j == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[j] += dj
            accepted[j] += aj
    return [a / d for a, d in zip(accepted, drafted) if d]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--head", help="the MTP sidecar [the one `outrider distill` cached for the target]")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", default="auto")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--engines", default="outrider,llama.cpp")
    parser.add_argument("--llama-configs", default="plain,ngram-simple,-md n-max 8 p-min 0.75",
                        help=f"llama-server's configurations, from: {', '.join(LLAMA_CONFIGS)}")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="llama-server's draft model, for -md")
    parser.add_argument("--other-head", help="a second MTP sidecar, run as one more configuration beside the first")
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import apply_chat_template
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.native import cflags, vector_extensions
    from outrider.plugins.drafters.mtp.prompts import HELD_OUT_PROMPTS
    from outrider.plugins.drafters.mtp.drafter import mtp_sidecar_path

    target_path = resolve_model(args.target)
    head = Path(args.head) if args.head else mtp_sidecar_path(target_path)
    if not head.is_file():
        sys.exit(f"no MTP head at {head}: run `outrider distill {args.target}` first, or pass --head")
    g = GGUFFile(target_path)
    tokenizer = Tokenizer.from_gguf(g)
    texts = {f"held-out code {i + 1}": text for i, text in enumerate(HELD_OUT_PROMPTS)}
    texts["code edit"] = PAIR_PROMPTS["code edit"]
    rendered = {label: apply_chat_template(g, tokenizer, [{"role": "user", "content": text}])
                for label, text in texts.items()}
    prompts = {label: tokenizer.encode(text) for label, text in rendered.items()}
    temperatures = [float(t) for t in args.temperatures.split(",")]

    llama_configs = args.llama_configs.split(",") if args.llama_configs else []
    unknown = [c for c in llama_configs if c not in LLAMA_CONFIGS]
    if unknown:
        sys.exit(f"unknown --llama-configs {', '.join(unknown)}: choose from {', '.join(LLAMA_CONFIGS)}")
    server_path = llama_server_binary() if "llama.cpp" in args.engines.split(",") else None
    draft_path = resolve_model(args.draft) if server_path and any("-md" in LLAMA_CONFIGS[c] for c in llama_configs) \
        else target_path
    target, runners = outrider_runners(target_path, head, temperatures, args.threads, args.draft_max,
                                       Path(args.other_head) if args.other_head else None)
    servers = {}
    peer, results = {}, {}  # {(prompt, T, config): [row per measured round]}
    try:
        for config in llama_configs if server_path else ():
            servers[config] = LlamaServer(server_path, target_path, draft_path, LLAMA_CONFIGS[config], args.threads)
        for run in range(args.runs + 1):  # the first is a warm-up
            for label, ids in prompts.items():
                for t in temperatures:
                    for config, server in servers.items():
                        row = server.decode(rendered[label], args.tokens, t, 1 + run, top_k=0, top_p=1.0)
                        if run:
                            peer.setdefault((label, t, config), []).append(row)
                    for (runner_t, name), runner in runners.items():
                        if runner_t == t:
                            row = outrider_round(target, runner, ids, args.tokens, t, 1 + run)
                            if run:
                                results.setdefault((label, t, name), []).append(row)
            print(f"round {run} of {args.runs} done" + (" (warm-up)" if not run else ""), file=sys.stderr)
    finally:
        for server in servers.values():
            server.close()

    print(f"CPU vector extensions: {' '.join(vector_extensions())}; "
          f"Outrider's kernels built with {' '.join(cflags())}; "
          f"llama-server: {server_path or 'not run'}; {args.threads} threads; {args.tokens} tokens; medians of "
          f"{args.runs} rounds; draft-max {args.draft_max}; head {head}"
          + (f"; other head {args.other_head}" if args.other_head else "") + "\n")
    print("| prompt | T | configuration | decode tok/s | vs plain | vs llama.cpp plain | vs llama.cpp's best "
          "| accepted per position |")
    print("|---|---|---|---|---|---|---|---|")
    for label in prompts:
        for t in temperatures:
            speeds = {c: statistics.median(r[0] for r in peer[label, t, c]) for c in llama_configs
                      if (label, t, c) in peer}
            best = max(speeds, key=speeds.get) if speeds else None
            for config, speed in speeds.items():
                accepted = [r[2] for r in peer[label, t, config] if r[2] == r[2]]
                vs_plain = f"{round_ratio(peer[label, t, config], peer[label, t, 'plain']):.2f}x" \
                    if "plain" in speeds else ""
                print(f"| {label} | {t:g} | llama.cpp {config} | {speed:.1f} | | {vs_plain} | | "
                      + (f"{statistics.median(accepted):.2f} (median)" if accepted else "") + " |")
            plain = results[label, t, "none"]
            for name in CONFIGS + ((OTHER_HEAD,) if args.other_head else ()):
                rows = results[label, t, name]
                speed = statistics.median(r[0] for r in rows)
                vs_plain = f"{round_ratio(rows, peer[label, t, 'plain']):.2f}x" if "plain" in speeds else ""
                vs_best = f"{round_ratio(rows, peer[label, t, best]):.2f}x ({best})" if best else ""
                positions = " ".join(f"{a:.2f}" for a in per_position(rows)[:6])
                print(f"| {label} | {t:g} | {name} | {speed:.1f} | {round_ratio(rows, plain):.2f}x | {vs_plain} "
                      f"| {vs_best} | {positions} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
