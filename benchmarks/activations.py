"""Activation modes side by side: the time of one forward over k new rows (a decode step, a verify pass,
a prompt chunk) after a fixed prefix, with the CPU backend's compact kernels in float32 and int8 mode,
modes alternated within every repetition, in one run.

    python benchmarks/activations.py MODEL.gguf [MODEL.gguf ...] [--rows 1 2 4 8] [--reps 15] [--threads 1]
    python benchmarks/activations.py MODEL.gguf --prompt --prefix 0 --rows 512 --reps 3    # prefill

For each model and mode it prints the median time per k in ms, and int8's time over float32's for the
same k (below 1: int8 is faster). This is what `-o backend.activations auto` is chosen from
(README, Numerics); name the CPU's vector extensions beside any figure you quote.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider import native
from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend

MODES = ("float32", "int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefix", type=int, default=128, help="tokens in the cache before each forward")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", action="store_true",
                        help="forwards as a prompt: logits of the last row only (llama-bench -p compares with this)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extensions = " ".join(native.vector_extensions()) or "none of " + " ".join(native.VECTOR_EXTENSIONS)
    print(f"CPU vector extensions: {extensions}; "
          f"kernels built with {' '.join(native.cflags())}")
    for path in args.models:
        model = CPUBackend().load_model(GGUFFile(path))
        cache = model.new_cache(args.prefix + max(args.rows) + 1)
        gen = torch.Generator().manual_seed(0)
        high = min(1000, model.config.vocab_size)
        model.forward(torch.randint(0, high, (args.prefix,), generator=gen), 0, cache)
        blocks = {k: torch.randint(0, high, (k,), generator=gen) for k in args.rows}
        seconds = {(mode, k): [] for mode in MODES for k in args.rows}
        for mode in MODES:  # one untimed forward of each shape first: the timed ones find warm caches alike
            with native.activations(mode):
                for k in args.rows:
                    model.forward(blocks[k], args.prefix, cache, last_only=args.prompt)
                    cache.truncate(args.prefix)
        for _ in range(args.reps):
            for mode in MODES:
                with native.activations(mode):
                    for k in args.rows:
                        start = time.perf_counter()
                        model.forward(blocks[k], args.prefix, cache, last_only=args.prompt)
                        seconds[mode, k].append(time.perf_counter() - start)
                        cache.truncate(args.prefix)
        kind = "prompt forward (last row's logits)" if args.prompt else "forward"
        print(f"{path}: {args.threads} thread(s), median of {args.reps}, ms per {kind}")
        print("rows     " + "".join(f"{k:>10}" for k in args.rows))
        median = {key: statistics.median(times) * 1e3 for key, times in seconds.items()}
        for mode in MODES:
            print(f"{mode:9s}" + "".join(f"{median[mode, k]:10.2f}" for k in args.rows))
        print("int8/f32 " + "".join(f"{median['int8', k] / median['float32', k]:10.2f}" for k in args.rows))


if __name__ == "__main__":
    main()
