"""How fast does `outrider distill` write the target's answers? Its `generate` (B answers side by side,
`Decoder.forward_sequences`, one row each) beside llama-server decoding the same B prompts in B parallel slots, in one run.

The target is the catalog's Qwen2.5-Coder-1.5B (Q4_K_M); the prompts are distill's own coding prompts through the
file's chat template, sent to llama-server as the same token ids. Every answer runs to `--tokens` (no stop
token: llama-server with `ignore_eos`), greedy. Printed per batch size: answer tokens per second of wall time, the
B prompts' prefill included (the first request sent to the last answer back for llama-server), medians of
`--runs` interleaved rounds, and Outrider's over llama-server's. A llama-server built for AVX2 against Outrider's
AVX2 path: `OUTRIDER_NATIVE_MARCH=x86-64-v3 LLAMA_SERVER=.../build-avx2/bin/llama-server`.

    python benchmarks/batched_answers.py --threads 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen_pair import LlamaServer, cpu_target, llama_server_binary  # noqa: E402


def server_answers(server: LlamaServer, prompts: list[list[int]], tokens: int) -> float:
    """Answer tokens per second of wall time, the B prompts sent at once (each to its own slot)."""
    def one(ids: list[int]) -> int:
        body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)["timings"]["predicted_n"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        written = sum(pool.map(one, prompts))
    return written / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import template_or_raw_ids
    from outrider.native import cflags, vector_extensions
    from outrider.plugins.drafters.mtp.distill import generate
    from outrider.plugins.drafters.mtp.prompts import CODE_PROMPTS

    torch.set_num_threads(args.threads)
    target_path = resolve_model(args.target)
    target = cpu_target(target_path, args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [template_or_raw_ids(target.gguf, target.tokenizer, text)[0] for text in CODE_PROMPTS[:max(batches)]]
    binary = llama_server_binary()
    server = LlamaServer(binary, target_path, target_path,
                         ["-np", str(max(batches)), "-c", str(max(batches) * 512)], args.threads)
    ours: dict[int, list[float]] = {b: [] for b in batches}
    peer: dict[int, list[float]] = {b: [] for b in batches}
    try:
        for run in range(args.runs + 1):  # a warm-up round first
            for b in batches:
                t0 = time.perf_counter()
                outs = generate(target.model, prompts[:b], args.tokens, [0.0] * b, torch.Generator(), set())
                speed = sum(map(len, outs)) / (time.perf_counter() - t0)
                peer_speed = server_answers(server, prompts[:b], args.tokens)
                if run:
                    ours[b].append(speed)
                    peer[b].append(peer_speed)
    finally:
        server.close()
    print(f"CPU vector extensions: {' '.join(vector_extensions())}; Outrider's kernels built with {' '.join(cflags())}; "
          f"llama-server: {binary}; {args.threads} threads; {args.tokens} tokens an answer, greedy; medians of "
          f"{args.runs} rounds\n")
    print("| answers at once | Outrider tok/s | llama-server tok/s | Outrider / llama-server |")
    print("|---|---|---|---|")
    for b in batches:
        o, p = statistics.median(ours[b]), statistics.median(peer[b])
        print(f"| {b} | {o:.1f} | {p:.1f} | {o / p:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
