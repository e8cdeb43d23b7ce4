"""GPU benchmark of the cuda backend: decode tok/s beside the HBM bandwidth bound, and the verify cost curve
c(k)/c(1) for k = 1..16, for the new path (compact weights + CUDA graphs), compact weights without graphs,
and the old path (every weight dequantized to bfloat16, eager ops), side by side in one run.

Models are synthetic: random weights of real shapes, quantized with gguf-py (Q4_0 or Q8_0) and written here,
so the machine that runs this needs no network and no model files. Shapes: Llama-3.2-1B, Llama-3.1-8B, the
two small real models Outrider ships with (SmolLM2-135M, Gemma-3-270M), and the Qwen2.5-Coder 1.5B + 0.5B pair. Each distinct tensor shape is quantized
once and its bytes reused by every layer (same bytes read per token; the values do not matter here).

    python benchmarks/gpu.py --models llama-1b llama-8b smollm2-135m gemma3-270m --quants Q4_0 Q8_0
    python benchmarks/gpu.py --smoke          # tiny shapes on the CPU (no graphs): checks the script runs

Decode: greedy, one token per forward, the next token fed back on the device (no host sync per token),
after a 128-token prompt; medians of --runs. The bound is bytes held per token (weights the step reads,
from the model's own tensors) / the device's measured read bandwidth (a reduction over a 4 GiB buffer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from outrider.bench import tensor_bytes
from outrider.io.gguf import GGUFFile
from outrider.models import ARCHITECTURES
from outrider.models.static_step import StaticStepModel


@dataclass(frozen=True)
class Shape:
    arch: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    window: int = 0  # gemma3 sliding window


SHAPES = {
    "llama-1b": Shape("llama", 128256, 2048, 16, 32, 8, 64, 8192, tied=True),
    "llama-8b": Shape("llama", 128256, 4096, 32, 32, 8, 128, 14336, tied=False),
    "smollm2-135m": Shape("llama", 49152, 576, 30, 9, 3, 64, 1536, tied=True),
    "gemma3-270m": Shape("gemma3", 262144, 640, 18, 4, 1, 256, 2048, tied=True, window=512),
    "qwen2.5-1.5b": Shape("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, tied=False),  # the catalog's pair
    "qwen2.5-0.5b": Shape("qwen2", 151936, 896, 24, 14, 2, 64, 4864, tied=False),
    "tiny-llama": Shape("llama", 512, 128, 2, 4, 2, 32, 256, tied=False),
    "tiny-gemma3": Shape("gemma3", 512, 128, 3, 4, 1, 32, 256, tied=True, window=16),
    "tiny-qwen2": Shape("qwen2", 512, 128, 2, 4, 2, 32, 256, tied=False),
}
VARIANTS = {  # label: (weights, graphs); the old path first, so the others print their ratio to it
    "dense bf16 eager (old)": ("dense", False),
    "compact eager": ("compact", False),
    "compact+graphs": ("compact", True),
}
CONTEXT = 1024
SMOKE_KS = (1, 2, 16)  # --smoke times three verify shapes, enough to run every line


def write_synthetic(path: Path, shape: Shape, qtype_name: str, seed: int = 0, embd_qtype_name: str | None = None) -> Path:
    """A GGUF of `shape` with random weights in `qtype_name` (the token table, and so a tied head, in
    `embd_qtype_name` if given, as real files often hold it in Q8_0; norms are ones): no tokenizer, which
    the benchmarks do not need."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    embd_qtype = gguf.GGMLQuantizationType[embd_qtype_name or qtype_name]
    rng = np.random.default_rng(seed)
    quantized: dict[tuple[int, int, int], np.ndarray] = {}

    def matrix(rows: int, cols: int, as_type=qtype) -> np.ndarray:
        if (rows, cols, as_type) not in quantized:
            quantized[rows, cols, as_type] = gguf.quants.quantize(
                (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02), as_type)
        return quantized[rows, cols, as_type]

    s = shape
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    if s.arch == "llama":
        w.add_rope_dimension_count(s.head_dim)
        w.add_rope_freq_base(500000.0)
    elif s.arch == "qwen2":
        w.add_rope_freq_base(1_000_000.0)
    else:
        w.add_rope_freq_base(1_000_000.0)
        w.add_sliding_window(s.window)
    ones = np.ones(s.hidden, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(s.vocab, s.hidden, embd_qtype), raw_dtype=embd_qtype)
    if not s.tied:
        w.add_tensor("output.weight", matrix(s.vocab, s.hidden), raw_dtype=qtype)
    w.add_tensor("output_norm.weight", ones)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p = f"blk.{i}."
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if s.arch == "gemma3" else [])
        for norm in norms:
            w.add_tensor(p + norm + ".weight", ones)
        if s.arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", np.ones(s.head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(s.head_dim, dtype=np.float32))
        for name, rows, cols in (("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden),
                                 ("attn_output", s.hidden, q), ("ffn_gate", s.ffn, s.hidden),
                                 ("ffn_up", s.ffn, s.hidden), ("ffn_down", s.hidden, s.ffn)):
            w.add_tensor(p + name + ".weight", matrix(rows, cols), raw_dtype=qtype)
        if s.arch == "qwen2":
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(p + name + ".bias", np.zeros(rows, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(g: GGUFFile, variant: str, device: torch.device):
    weights, graphs = VARIANTS[variant]
    if device.type == "cuda":
        from outrider.plugins.backends.cuda import CUDABackend

        return CUDABackend(weights=weights, graphs=graphs).load_model(g)
    # --smoke: the same forms on the CPU, float32, the fixed-shape step run eagerly
    model = ARCHITECTURES[g.architecture](g, dtype=torch.float32, device="cpu", native=False,
                                          attention_dtype=torch.float32,
                                          linear_form="quantized" if weights == "compact" else None)
    return StaticStepModel(model, graphs=False) if graphs else model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth_gbs(device: torch.device, gib: float) -> float:
    """Sustained read bandwidth of `device`: a sum over a buffer far larger than any cache."""
    buffer = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device)
    buffer.sum()
    times = []
    for _ in range(7):
        sync(device)
        t = time.perf_counter()
        buffer.sum()
        sync(device)
        times.append(time.perf_counter() - t)
    return buffer.numel() * 2 / statistics.median(times) / 1e9


def decode_tokens_per_s(model, device: torch.device, cache, n_tokens: int, prompt_len: int = 128) -> float:
    """One cache for every run: CUDA graphs belong to a cache, so a fresh one would time a capture too."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, min(vocab, 1000), (prompt_len,), generator=torch.Generator().manual_seed(0))
    logits = model.forward(prompt.to(device), 0, cache, last_only=True)
    token = logits[-1:].argmax(dim=-1)
    sync(device)
    t = time.perf_counter()
    for i in range(n_tokens):
        token = model.forward(token, prompt_len + i, cache)[-1:].argmax(dim=-1)
    sync(device)
    return n_tokens / (time.perf_counter() - t)


def verify_cost_curve(model, device: torch.device, prompt_len: int = 128, reps: int = 9,
                      ks: range = range(1, 17)) -> dict[int, float]:
    """Median seconds of one forward over k tokens after a prompt, relative to k = 1."""
    vocab = model.config.vocab_size
    cache = model.new_cache(prompt_len + 17)
    gen = torch.Generator().manual_seed(1)
    model.forward(torch.randint(0, min(vocab, 1000), (prompt_len,), generator=gen).to(device), 0, cache, last_only=True)
    seconds = {}
    for k in ks:
        block = torch.randint(0, min(vocab, 1000), (k,), generator=gen).to(device)
        model.forward(block, prompt_len, cache)  # first use of a shape captures its graph
        times = []
        for _ in range(reps):
            cache.truncate(prompt_len)
            sync(device)
            t = time.perf_counter()
            model.forward(block, prompt_len, cache)
            sync(device)
            times.append(time.perf_counter() - t)
        seconds[k] = statistics.median(times)
    return {k: seconds[k] / seconds[ks[0]] for k in seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=list(SHAPES),
                        help="default: llama-1b llama-8b smollm2-135m gemma3-270m (--smoke: the tiny ones)")
    parser.add_argument("--quants", nargs="+", default=["Q4_0", "Q8_0"], choices=["Q4_0", "Q8_0"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the synthetic GGUFs are written (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few tokens: the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models = args.models or ["tiny-llama", "tiny-gemma3", "tiny-qwen2"]
        args.tokens, args.runs, device = 8, 1, torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    args.models = args.models or ["llama-1b", "llama-8b", "smollm2-135m", "gemma3-270m"]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="outrider-gpu-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bandwidth = read_bandwidth_gbs(device, 1 / 16 if args.smoke else 4.0)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else "CPU (smoke: float32, the graphed path run eagerly; the numbers say nothing about a GPU)")
    print(f"device: {name}, torch {torch.__version__}, measured read bandwidth {bandwidth:.0f} GB/s\n")
    print("| model | quant | path | MB read/token | bound tok/s | decode tok/s (median) | of bound | vs old |")
    print("|---|---|---|---|---|---|---|---|")
    curves = {}
    for model_name in args.models:
        for quant in args.quants:
            t = time.perf_counter()
            path = write_synthetic(workdir / f"{model_name}-{quant}.gguf", SHAPES[model_name], quant)
            print(f"<!-- wrote {path.name} in {time.perf_counter() - t:.0f} s -->", flush=True)
            g = GGUFFile(path)
            speeds = {}
            for variant in args.variants:
                t = time.perf_counter()
                model = load(g, variant, device)
                loaded = time.perf_counter() - t
                held = tensor_bytes(model)
                cache = model.new_cache(128 + args.tokens + 1)
                decode_tokens_per_s(model, device, cache, 4)  # warm-up: graphs captured, kernels chosen
                speeds[variant] = statistics.median(decode_tokens_per_s(model, device, cache, args.tokens)
                                                    for _ in range(args.runs))
                del cache
                bound = bandwidth * 1e9 / held
                old = speeds.get("dense bf16 eager (old)")
                ratio = f"{speeds[variant] / old:.2f}x" if old and variant != "dense bf16 eager (old)" else ""
                speed = speeds[variant]
                print(f"| {model_name} | {quant} | {variant} | {held / 1e6:.0f} | {bound:.0f} | {speed:.1f} | "
                      f"{speed / bound:.0%} | {ratio} | <!-- load {loaded:.0f} s -->", flush=True)
                curves[model_name, quant, variant] = verify_cost_curve(model, device, reps=1 if args.smoke else 9,
                                                                       ks=SMOKE_KS if args.smoke else range(1, 17))
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            g.close()
            path.unlink()
    print("\nverify cost c(k)/c(1): one forward over k tokens relative to one token (median)\n")
    keys = list(curves)
    print("| k | " + " | ".join(f"{m} {q} {v}" for m, q, v in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for k in curves[keys[0]] if keys else ():
        print(f"| {k} | " + " | ".join(f"{curves[key][k]:.2f}" for key in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
