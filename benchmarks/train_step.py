"""What a step of `outrider distill`'s training costs, and what it cost before the head's optimizer was fused and
its stacked projections (q/k/v, gate/up) were run a product per part: the three forms side by side, interleaved
rounds, medians.

    unfused   torch's default AdamW (on a CPU: a loop over the parameters), q/k/v and gate/up weights stacked
              at every call
    fused     AdamW(fused=True), weights still stacked
    now       AdamW(fused=True), a product per part and the outputs joined (what distill and learn run)

A step is the head's loss on one sample of --rows tokens (the target's hidden rows and top-k probabilities drawn at
random: a step's cost does not hang on their values), its backward, gradient clipping and the update, at the
precision distill picks (`--precision auto`: bfloat16 autocast where the CPU multiplies bfloat16).

    python benchmarks/train_step.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from outrider.models.linear import DenseLinear, StackedLinear
from outrider.native import cpu_flags
from outrider.plugins.drafters.mtp.distill import Sample, load_trunk, sample_loss
from outrider.plugins.drafters.mtp.head import TrainableHead, cpu_has_bf16_matmul

FORMS = ("unfused", "fused", "now")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per form per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, g, model, _ = load_trunk(args.model)
    vocab = torch.arange(8192)
    gen = torch.Generator().manual_seed(0)
    h = model.config.hidden_size
    sample = Sample(torch.randint(0, 8192, (args.rows,), generator=gen),
                    torch.randn(args.rows, h, generator=gen).half(),
                    torch.randint(0, 8192, (args.rows, 16), generator=gen),
                    torch.softmax(torch.randn(args.rows, 16, generator=gen), -1))
    heads = {form: TrainableHead(model, g, vocab) for form in FORMS}
    optimizers = {"unfused": torch.optim.AdamW(heads["unfused"].trained_parameters(), lr=1e-4),
                  "fused": heads["fused"].optimizer(1e-4), "now": heads["now"].optimizer(1e-4)}
    per_part = StackedLinear.product

    def run(form: str, n: int) -> float:
        StackedLinear.product = DenseLinear.product if form != "now" else per_part  # the weights stacked, or not
        head, opt = heads[form], optimizers[form]
        t = time.perf_counter()
        for _ in range(n):
            head.train_step(opt, lambda: sample_loss(head, sample, 0.1, args.depth), args.precision)
        return (time.perf_counter() - t) / n

    try:
        for form in FORMS:
            run(form, 2)  # warm-up
        times = {form: [] for form in FORMS}
        for _ in range(args.rounds):
            for form in FORMS:
                times[form].append(run(form, args.steps))
    finally:
        StackedLinear.product = per_part
    flags = " ".join(f for f in cpu_flags().split() if f.startswith(("avx", "amx", "fma", "f16c")))
    bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16_matmul())
    print(f"{args.model}, {args.rows} rows, depth {args.depth}, {'bfloat16 autocast' if bf16 else 'float32'} "
          f"(--precision {args.precision}), {args.threads} threads")
    print(f"CPU: {flags}")
    base = statistics.median(times["unfused"])
    for form in FORMS:
        m = statistics.median(times[form])
        print(f"{form:8s} {1000 * m:7.0f} ms a step   {base / m:5.2f}x the unfused step")


if __name__ == "__main__":
    main()
