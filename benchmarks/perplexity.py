"""Perplexity of every catalog model with int8 and float32 activations, beside llama-perplexity's on the same
file and text, in one run: what the activation mode costs in the figure llama.cpp users judge a quant by.

    python benchmarks/perplexity.py [--models smollm2-135m,...] [--ctx 512] [--chunks 8] [--threads 2]

The text is the start of the Python documentation's topic pages (`pydoc_data.topics`, which ships with
CPython: English prose with code in it), written to a file whose path is printed, so either tool can be run
on it by hand. llama-perplexity: `$LLAMA_PERPLEXITY`, else the build of `../shared/tools/build-llama-cpp
--no-amx`. Prints a markdown table (docs/bench/perplexity.md holds the runs, with their machines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # qwen_pair.py's llama.cpp tools
from qwen_pair import llama_cpp_binary  # noqa: E402

TEXT_CHARS = 60_000


def corpus_file(folder: Path) -> Path:
    from pydoc_data.topics import topics

    path = folder / "pydoc-topics.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics))[:TEXT_CHARS], encoding="utf-8")
    return path


def outrider_ppl(model: str, text: Path, ctx: int, chunks: int, threads: int, activations: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-m", "outrider", "perplexity", model, str(text), "-c", str(ctx),
                          "--chunks", str(chunks), "-t", str(threads), "-o", "backend.activations", activations,
                          "--json"], capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    return report["perplexity"], report["uncertainty"]


def llama_ppl(binary: Path, path: Path, text: Path, ctx: int, chunks: int, threads: int) -> tuple[float, float]:
    out = subprocess.run([str(binary), "-m", str(path), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
                          "-t", str(threads)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{out.stderr[-2000:]}")
    return float(found.group(1)), float(found.group(2))


def main() -> None:
    from outrider.catalog import CATALOG, ensure_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CATALOG))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    binary = llama_cpp_binary("llama-perplexity", "LLAMA_PERPLEXITY")
    folder = Path(tempfile.mkdtemp(prefix="outrider-ppl-"))
    text = corpus_file(folder)
    print(f"text: {text} (the first {TEXT_CHARS} characters of pydoc_data.topics); -c {args.ctx} --chunks "
          f"{args.chunks} -t {args.threads}; llama-perplexity: {binary}\n")
    print("| model | llama-perplexity | Outrider int8 activations | Outrider float32 activations |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        path = ensure_model(name)
        cells = [llama_ppl(binary, path, text, args.ctx, args.chunks, args.threads)]
        for mode in ("int8", "float32"):
            cells.append(outrider_ppl(name, text, args.ctx, args.chunks, args.threads, mode))
        print(f"| {name} | " + " | ".join(f"{p:.4f} ± {u:.4f}" for p, u in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
