"""Gemma 4 E2B decode speed on the CPU backend, beside the memory-bandwidth bound, and Gemma 3 270M in the same run.

    python benchmarks/gemma4_e2b.py [--tokens 16] [--runs 3] [--keep DIR]

Both targets are synthetic: random weights in the real models' shapes, quantized with gguf-py (`gguf.quants`,
Q4_0 for the layers, Q8_0 for the tied embedding / output head and the per-layer token table) and written to a
temporary GGUF with llama.cpp's keys. Decode speed does not depend on the values, only on the bytes streamed per
token. To keep the file quick to write, one random block of rows per tensor shape is quantized and tiled: every
tensor is still its own bytes in the file and in memory.

Gemma 4 E2B shapes (its public config; llama.cpp's loader names a 35-layer gemma4 "E2B"): hidden 1536, 35
layers (four sliding, then one global), 8 query heads and 1 kv head, head dim 256 (sliding) / 512 (global),
FFN 6144 (12288 on the 20 KV-sharing layers), per-layer inputs of 256, vocabulary 262144, window 512.
Gemma 3 270M: hidden 640, 18 layers, 4 heads, 1 kv head, head dim 256, FFN 2048, vocabulary 262144.

The bound is the measured read bandwidth divided by the bytes the model reads per token as held in memory
(`weight_tensors()`: codes plus float32 scales); medians of --runs runs of --tokens one-token steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from outrider.bench import read_bandwidth_gbs
from outrider.io.gguf import GGUFFile
from outrider.models import load_model
from outrider.testing.tiny_models import add_gemma4_hparams

Q = gguf.GGMLQuantizationType
VOCAB = 262144
_blocks: dict[tuple, np.ndarray] = {}


def _quantized(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols] random weights as gguf-py quantizes them: one block of up to 512 rows, tiled."""
    key = (min(rows, 512), cols, qtype)
    if key not in _blocks:
        _blocks[key] = gguf.quants.quantize((rng.standard_normal(key[:2]) * 0.05).astype(np.float32), qtype)
    block = _blocks[key]
    return np.ascontiguousarray(np.tile(block, (-(-rows // block.shape[0]), 1))[:rows])


def _matrix(w: gguf.GGUFWriter, name: str, rows: int, cols: int, qtype: Q, rng) -> None:
    w.add_tensor(name, _quantized(rows, cols, qtype, rng), raw_dtype=qtype)


def _norm(w: gguf.GGUFWriter, name: str, n: int) -> None:
    w.add_tensor(name, np.ones(n, dtype=np.float32))


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gemma4_e2b(path: Path, rng) -> Path:
    n, hidden, heads, hd_swa, hd_full, ffn, ple, first_shared = 35, 1536, 8, 256, 512, 6144, 256, 15
    local = [i % 5 != 4 for i in range(n)]
    ffns = [ffn if i < first_shared else 2 * ffn for i in range(n)]
    w = gguf.GGUFWriter(str(path), "gemma4")
    add_gemma4_hparams(w, n_layers=n, context=4096, hidden=hidden, heads=heads, kv_heads=1, hd_swa=hd_swa,
                       hd_full=hd_full, window=512, first_shared=first_shared, per_layer_input=ple, ffns=ffns,
                       local=local)
    n_rot = hd_full // 8
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32))
    _matrix(w, "token_embd.weight", VOCAB, hidden, Q.Q8_0, rng)
    _matrix(w, "per_layer_token_embd.weight", VOCAB, n * ple, Q.Q8_0, rng)
    _matrix(w, "per_layer_model_proj.weight", n * ple, hidden, Q.Q8_0, rng)
    _norm(w, "per_layer_proj_norm.weight", ple)
    _norm(w, "output_norm.weight", hidden)
    for i in range(n):
        p, hd = f"blk.{i}.", hd_swa if local[i] else hd_full
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            _norm(w, p + name + ".weight", hidden)
        _norm(w, p + "attn_q_norm.weight", hd)
        _matrix(w, p + "attn_q.weight", heads * hd, hidden, Q.Q4_0, rng)
        if i < first_shared:
            _norm(w, p + "attn_k_norm.weight", hd)
            _matrix(w, p + "attn_k.weight", hd, hidden, Q.Q4_0, rng)
            _matrix(w, p + "attn_v.weight", hd, hidden, Q.Q4_0, rng)
        _matrix(w, p + "attn_output.weight", hidden, heads * hd, Q.Q4_0, rng)
        for name in ("ffn_gate", "ffn_up"):
            _matrix(w, p + name + ".weight", ffns[i], hidden, Q.Q4_0, rng)
        _matrix(w, p + "ffn_down.weight", hidden, ffns[i], Q.Q4_0, rng)
        _matrix(w, p + "inp_gate.weight", ple, hidden, Q.Q4_0, rng)
        _matrix(w, p + "proj.weight", hidden, ple, Q.Q4_0, rng)
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.5], dtype=np.float32))
    _finish(w)
    return path


def write_gemma3_270m(path: Path, rng) -> Path:
    n, hidden, heads, hd, ffn = 18, 640, 4, 256, 2048
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(n)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(512)
    _matrix(w, "token_embd.weight", VOCAB, hidden, Q.Q8_0, rng)
    _norm(w, "output_norm.weight", hidden)
    for i in range(n):
        p = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            _norm(w, p + name + ".weight", hidden)
        _norm(w, p + "attn_q_norm.weight", hd)
        _norm(w, p + "attn_k_norm.weight", hd)
        _matrix(w, p + "attn_q.weight", heads * hd, hidden, Q.Q4_0, rng)
        _matrix(w, p + "attn_k.weight", hd, hidden, Q.Q4_0, rng)
        _matrix(w, p + "attn_v.weight", hd, hidden, Q.Q4_0, rng)
        _matrix(w, p + "attn_output.weight", hidden, heads * hd, Q.Q4_0, rng)
        _matrix(w, p + "ffn_gate.weight", ffn, hidden, Q.Q4_0, rng)
        _matrix(w, p + "ffn_up.weight", ffn, hidden, Q.Q4_0, rng)
        _matrix(w, p + "ffn_down.weight", hidden, ffn, Q.Q4_0, rng)
    _finish(w)
    return path


def held_bytes(model) -> int:
    seen, total = set(), 0
    for t in model.weight_tensors():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_tokens_per_s(model, n_tokens: int) -> float:
    """One-token steps after a 32-token prompt, each feeding back its argmax, as plain decoding does."""
    cache = model.new_cache(64 + n_tokens)
    logits = model.forward(torch.arange(100, 132), 0, cache, last_only=True)
    start = time.perf_counter()
    for _ in range(n_tokens):
        logits = model.forward(logits[-1:].argmax(-1), cache.length, cache)
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", help="write the synthetic GGUFs here (reused if present) instead of a temp folder")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="outrider-bench-") as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        files = {}
        targets = (("Gemma 4 E2B (synthetic)", write_gemma4_e2b), ("Gemma 3 270M (synthetic)", write_gemma3_270m))
        for name, write in targets:
            path = folder / (write.__name__.removeprefix("write_") + ".gguf")
            started = time.perf_counter()
            files[name] = path if path.is_file() else write(path, rng)
            print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s to write)")
        bandwidth = read_bandwidth_gbs()
        print(f"\nthreads: {torch.get_num_threads()}, measured read bandwidth: {bandwidth:.1f} GB/s; CPU backend, "
              f"compact weights\n")
        print("| target | decode tok/s (median) | MB read per token | bandwidth bound tok/s | fraction of bound | "
              "load s |")
        print("|---|---|---|---|---|---|", flush=True)
        for name, path in files.items():
            started = time.perf_counter()
            model = load_model(GGUFFile(path), weights="compact")
            loaded = time.perf_counter() - started
            held = held_bytes(model)
            decode_tokens_per_s(model, 2)  # warm-up
            speed = statistics.median(decode_tokens_per_s(model, args.tokens) for _ in range(args.runs))
            bound = bandwidth * 1e9 / held
            print(f"| {name} | {speed:.2f} | {held / 1e6:.0f} | {bound:.2f} | {speed / bound:.0%} | {loaded:.0f} |",
                  flush=True)
            del model


if __name__ == "__main__":
    main()
