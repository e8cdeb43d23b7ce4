"""Activation modes side by side: the time of one forward over k new rows (a decode step, a verify pass,
a prompt chunk) after a fixed prefix, with the CPU backend's compact kernels in float32 and int8 mode,
modes alternated within every repetition, in one run.

    python benchmarks/activations.py MODEL.gguf [MODEL.gguf ...] [--rows 1 2 4 8] [--reps 15] [--threads 1]
    python benchmarks/activations.py MODEL.gguf --prompt --prefix 0 --rows 512 --reps 3    # prefill
    python benchmarks/activations.py MODEL.gguf --amx [--amx-min-rows 1]    # int8: dpbusd tiles vs AMX
    python benchmarks/activations.py --synthetic smollm2-135m:Q4_1:Q8_0 ...  # random weights of that shape

For each model and mode it prints the median time per k in ms, and int8's time over float32's for the
same k (below 1: int8 is faster); with --amx, int8 with AMX tiles from --amx-min-rows rows against int8
without them (CPUs with amx_int8). This is what `-o backend.activations auto` is chosen from
(README, Numerics); name the CPU's vector extensions beside any figure you quote.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from outrider import native
from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend

sys.path.insert(0, str(Path(__file__).parent))  # gpu.py's synthetic shapes


@contextlib.contextmanager
def amx_from(rows: int):
    """int8 activations, lane tiles of `rows` or more rows on AMX (0: none)."""
    with native.activations("int8"):
        kernels = native.load()
        before = kernels.set_amx_min_rows(rows)
        try:
            yield
        finally:
            kernels.set_amx_min_rows(before)


def synthetic(spec: str) -> str:
    """SHAPE:QTYPE[:EMBD_QTYPE] (shapes of benchmarks/gpu.py) written once under the temp dir."""
    from gpu import SHAPES, write_synthetic

    shape, qtype, *embd = spec.split(":")
    path = Path(tempfile.gettempdir()) / f"outrider-synthetic-{spec.replace(':', '-')}.gguf"
    if not path.exists():  # written aside, then renamed: an interrupted write leaves no file to reuse
        partial = path.with_suffix(".partial")
        write_synthetic(partial, SHAPES[shape], qtype, embd_qtype_name=embd[0] if embd else None)
        partial.rename(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--synthetic", nargs="+", default=[], metavar="SHAPE:QTYPE[:EMBD_QTYPE]",
                        help="random weights of a model's shape (benchmarks/gpu.py's SHAPES), e.g. smollm2-135m:Q4_1:Q8_0")
    parser.add_argument("--amx", action="store_true", help="int8 without AMX tiles against int8 with them")
    parser.add_argument("--amx-min-rows", type=int, default=1, help="with --amx: tiles of this many rows or more take AMX")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefix", type=int, default=128, help="tokens in the cache before each forward")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", action="store_true",
                        help="forwards as a prompt: logits of the last row only (llama-bench -p compares with this)")
    args = parser.parse_args()
    if not args.models and not args.synthetic:
        parser.error("name a MODEL.gguf or a --synthetic SHAPE:QTYPE")
    if args.amx and not native.load().HAS_AMX_TILES:
        parser.error("--amx needs a CPU with amx_int8 (lscpu), kernels built for it (-march=native) and Linux 5.16+")
    models = args.models + [synthetic(spec) for spec in args.synthetic]
    if args.amx:
        modes = {"dpbusd": lambda: amx_from(0), "amx": lambda: amx_from(args.amx_min_rows)}
    else:
        modes = {mode: (lambda mode=mode: native.activations(mode)) for mode in ("float32", "int8")}
    old, new = modes
    torch.set_num_threads(args.threads)
    extensions = " ".join(native.vector_extensions()) or "none of " + " ".join(native.VECTOR_EXTENSIONS)
    print(f"CPU vector extensions: {extensions}; "
          f"kernels built with {' '.join(native.cflags())}")
    for path in models:
        model = CPUBackend().load_model(GGUFFile(path))
        cache = model.new_cache(args.prefix + max(args.rows) + 1)
        gen = torch.Generator().manual_seed(0)
        high = min(1000, model.config.vocab_size)
        model.forward(torch.randint(0, high, (args.prefix,), generator=gen), 0, cache)
        blocks = {k: torch.randint(0, high, (k,), generator=gen) for k in args.rows}
        seconds = {(mode, k): [] for mode in modes for k in args.rows}
        for mode in modes:  # one untimed forward of each shape first: the timed ones find warm caches alike
            with modes[mode]():
                for k in args.rows:
                    model.forward(blocks[k], args.prefix, cache, last_only=args.prompt)
                    cache.truncate(args.prefix)
        for _ in range(args.reps):
            for mode in modes:
                with modes[mode]():
                    for k in args.rows:
                        start = time.perf_counter()
                        model.forward(blocks[k], args.prefix, cache, last_only=args.prompt)
                        seconds[mode, k].append(time.perf_counter() - start)
                        cache.truncate(args.prefix)
        kind = "prompt forward (last row's logits)" if args.prompt else "forward"
        print(f"{path}: {args.threads} thread(s), median of {args.reps}, ms per {kind}")
        print("rows     " + "".join(f"{k:>10}" for k in args.rows))
        median = {key: statistics.median(times) * 1e3 for key, times in seconds.items()}
        for mode in modes:
            print(f"{mode:9s}" + "".join(f"{median[mode, k]:10.2f}" for k in args.rows))
        ratio = {"int8": "int8/f32", "amx": "amx/dpb"}[new]
        print(f"{ratio:9s}" + "".join(f"{median[new, k] / median[old, k]:10.2f}" for k in args.rows))


if __name__ == "__main__":
    main()
