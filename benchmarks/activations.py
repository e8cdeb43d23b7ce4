"""Activation modes side by side: the time of one forward over k new rows (a decode step, a verify pass,
a prompt chunk) after a fixed prefix, with the CPU backend's compact kernels in float32 and int8 mode,
modes alternated within every repetition, in one run.

    python benchmarks/activations.py MODEL.gguf [MODEL.gguf ...] [--rows 1 2 4 8] [--reps 15] [--threads 1]
    python benchmarks/activations.py MODEL.gguf --prompt --prefix 0 --rows 512 --reps 3    # prefill
    python benchmarks/activations.py MODEL.gguf --amx [--amx-min-rows 1]    # int8: dpbusd tiles vs AMX
    python benchmarks/activations.py --synthetic smollm2-135m:Q4_1:Q8_0 ...  # random weights of that shape
    python benchmarks/activations.py MODEL.gguf --floor    # int8 beside its integer products' floor
    python benchmarks/activations.py MODEL.gguf --scales   # int8: the file's compact forms vs float32 scales

For each model and mode it prints the median time per k in ms, and int8's time over float32's for the
same k (below 1: int8 is faster); with --scales, int8 with K-quants' scales held factored and Q6_K's codes
in six bits, as the file holds them (builds with F16C), against int8 with float32 scales and eight-bit codes
(OUTRIDER_FACTORED_SCALES=0 OUTRIDER_SIX_BIT_LANES=0), the model loaded in each form, with the megabytes of
weights a step reads; with --amx, int8 with AMX tiles from --amx-min-rows rows against int8
without them (CPUs with amx_int8); with --floor, int8 alone beside the least time its products can take:
rows x the weights a row meets / the rate one core gives a row in the build's lane tiles on registers
alone (no loads, no unpacking, no x to lay out; `outrider.native.product_rate_probe`) x threads: the integer products alone,
then with each group's float step, all in single steps too (over int8's one-row time), the unit of the
verify-cost targets. This is what `-o backend.activations auto` is chosen from
(docs/numerics.md); name the CPU's vector extensions beside any figure you quote.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from outrider import native
from outrider.bench.costs import tensor_bytes
from outrider.io.gguf import GGUFFile
from outrider.models.linear import KIND_Q4, KIND_Q5, KIND_Q8, PackedLinear
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


def held_forms(on: str | None):
    """OUTRIDER_FACTORED_SCALES and OUTRIDER_SIX_BIT_LANES set to `on` for a block (None: left as they are)."""
    names = ("OUTRIDER_FACTORED_SCALES", "OUTRIDER_SIX_BIT_LANES")
    return mock.patch.dict(os.environ, {} if on is None else {name: on for name in names})


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


def products_per_row(model) -> tuple[int, int]:
    """Products a row of x meets in one forward, (unsigned, signed) codes: 4-, 5- and six-bit codes (Q6_K's
    in the AVX2 lane form, `lane_form`), then 8-bit; every quantized linear whose tensors the model reads per
    token (its `weight_tensors`, which leave the embedding lookups out)."""
    read = {t.data_ptr() for t in model.weight_tensors() if t.numel()}
    linears = [o for o in gc.get_objects()  # type(), not isinstance: some of torch's objects warn when asked
               if issubclass(type(o), PackedLinear) and any(t.numel() and t.data_ptr() in read for t in o.tensors())]
    six_bit = lambda w: w.lanes and w.lanes[0].numel() * 4 == w.n_out * w.k * 3  # 24 bytes per 32 codes
    unsigned = sum(w.n_out * w.k for w in linears if w.kind in (KIND_Q4, KIND_Q5) or six_bit(w))
    return unsigned, sum(w.n_out * w.k for w in linears if w.kind == KIND_Q8 and not six_bit(w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--synthetic", nargs="+", default=[], metavar="SHAPE:QTYPE[:EMBD_QTYPE]",
                        help="random weights of a model's shape (benchmarks/gpu.py's SHAPES), e.g. smollm2-135m:Q4_1:Q8_0")
    parser.add_argument("--amx", action="store_true", help="int8 without AMX tiles against int8 with them")
    parser.add_argument("--scales", action="store_true",
                        help="int8 with float32 scales and 8-bit codes against the file's forms (factored scales, 6-bit Q6_K)")
    parser.add_argument("--amx-min-rows", type=int, default=1, help="with --amx: tiles of this many rows or more take AMX")
    parser.add_argument("--floor", action="store_true",
                        help="int8 beside the least time its integer products can take (this build's steps, one core x threads)")
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
    if args.floor and 1 not in args.rows:
        args.rows = [1] + args.rows  # the step the floor is counted in
    if args.scales and not native.load().FACTORED_SCALES:
        parser.error("--scales needs a build whose lane tiles read factored scales (AVX2 and F16C)")
    models = args.models + [synthetic(spec) for spec in args.synthetic]
    forms = {"": None}  # OUTRIDER_FACTORED_SCALES and _SIX_BIT_LANES each mode's model is loaded with (None: as set)
    if args.scales:
        modes = {mode: (lambda: native.activations("int8")) for mode in ("f32-scale", "file")}
        forms = {"f32-scale": "0", "file": "1"}
    elif args.amx:
        modes = {"dpbusd": lambda: amx_from(0), "amx": lambda: amx_from(args.amx_min_rows)}
    elif args.floor:
        if not native.load().HAS_INT8_KERNELS:
            parser.error("--floor needs the int8 kernels (a CPU with AVX2)")
        modes = {"int8": lambda: native.activations("int8")}
    else:
        modes = {mode: (lambda mode=mode: native.activations(mode)) for mode in ("float32", "int8")}
    torch.set_num_threads(args.threads)
    extensions = " ".join(native.vector_extensions()) or "none of " + " ".join(native.VECTOR_EXTENSIONS)
    print(f"CPU vector extensions: {extensions}; "
          f"kernels built with {' '.join(native.cflags())}")
    for path in models:
        loaded = {}
        for form, factored in forms.items():
            with held_forms(factored):
                model = CPUBackend().load_model(GGUFFile(path))
            cache = model.new_cache(args.prefix + max(args.rows) + 1)
            loaded[form] = model, cache
        model_of = {mode: loaded[mode if args.scales else ""] for mode in modes}
        gen = torch.Generator().manual_seed(0)
        high = min(1000, model.config.vocab_size)
        prefix = torch.randint(0, high, (args.prefix,), generator=gen)
        for model, cache in loaded.values():
            model.forward(prefix, 0, cache)
        blocks = {k: torch.randint(0, high, (k,), generator=gen) for k in args.rows}
        seconds = {(mode, k): [] for mode in modes for k in args.rows}
        for mode in modes:  # one untimed forward of each shape first: the timed ones find warm caches alike
            model, cache = model_of[mode]
            with modes[mode]():
                for k in args.rows:
                    model.forward(blocks[k], args.prefix, cache, last_only=args.prompt)
                    cache.truncate(args.prefix)
        for _ in range(args.reps):
            for mode in modes:
                model, cache = model_of[mode]
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
        if args.floor:
            probe, counts = native.product_rate_probe(), products_per_row(model)
            step = median["int8", 1]
            print(f"{'steps':9s}" + "".join(f"{median['int8', k] / step:10.2f}" for k in args.rows))
            for name, float_steps in (("products", False), ("+ float", True)):
                rates = [probe(0.5, signed, float_steps) * args.threads for signed in (False, True)]
                floor = {k: k * sum(n / rate for n, rate in zip(counts, rates)) * 1e3 for k in args.rows}
                print(f"{name:9s}" + "".join(f"{floor[k]:10.2f}" for k in args.rows) + "   floor, ms")
                print(f"{'  steps':9s}" + "".join(f"{floor[k] / step:10.2f}" for k in args.rows))
                print(f"  {name}: {rates[0] / 1e9:.0f} G products a second of 4-/5-bit codes, {rates[1] / 1e9:.0f} G of 8-bit "
                      f"({args.threads} x one core)")
            print(f"  a row meets {counts[0] / 1e6:.1f} M 4-/5-bit and {counts[1] / 1e6:.1f} M 8-bit codes")
            continue
        if args.scales:
            with native.activations("int8"):
                for mode in modes:
                    read = tensor_bytes(model_of[mode][0].weight_tensors())
                    print(f"  {mode}: a step reads {read / 1e6:,.1f} MB of weights")
        old, new = modes
        ratio = {"int8": "int8/f32", "amx": "amx/dpb", "file": "file/f32"}[new]
        print(f"{ratio:9s}" + "".join(f"{median[new, k] / median[old, k]:10.2f}" for k in args.rows))


if __name__ == "__main__":
    main()
