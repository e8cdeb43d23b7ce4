"""What a Gemma 4 assistant costs beside its target, on a synthetic E2B-shaped pair (random weights).

    python benchmarks/gemma_assistant.py [--vocab 262144] [--layers 35] [--reps 5] [--max-k 8] [--prompt 128]

Writes (once, under $OUTRIDER_HOME/bench/) an E2B-shaped gemma4 target GGUF (35 layers, hidden 1536, 8 heads,
1 kv head, head dims 256/512, 4 sliding : 1 global, the last 20 layers sharing KV, per-layer inputs of 256,
double-wide MLP on the sharing layers) and an assistant GGUF for it (4 layers [3 sliding, 1 global], hidden 256,
4 heads, backbone 1536, with the centroid head: vocab/128 centroids, top 32). Matrices are Q8_0 with random
codes (the CPU backend's int8 kernels), so the numbers are speed, not quality. Then, in this one run, medians of
--reps repetitions after a --prompt-token prompt:

- the cost of one drafted token (an assistant step over the target's cache, dense head and centroid head) as a
  fraction of one target decode step, r;
- the verify cost curve c(k)/c(1) of one target forward over k tokens;
- from both, the speed-up E[tokens per round] / (c(k+1)/c(1) + k r) a round of k drafts gives at per-token
  acceptance a (independent positions), the best k for each a, and the acceptance where the drafter pays.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from outrider.bench import forward_cost_curve, median_seconds
from outrider.catalog import outrider_home
from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend
from outrider.plugins.drafters.gemma_assistant.drafter import target_kv_layers
from outrider.plugins.drafters.gemma_assistant.model import Gemma4Assistant

E2B = dict(hidden=1536, heads=8, kv_heads=1, head_dim=256, global_head_dim=512, ffn=6144, per_layer=256,
           shared=20, window=512)
ASSISTANT = dict(hidden=256, layers=4, heads=4, ffn=2048, top_k=32)


def _q8_0(rng: np.random.Generator, rows: int, cols: int, scale: float = 0.01) -> np.ndarray:
    """Raw Q8_0 bytes [rows, cols/32 * 34] with random codes: a float16 scale, then 32 int8 codes per block."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 34), dtype=np.uint8)
    out[:, :2] = np.full(blocks, scale, dtype=np.float16).view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def _writer_helpers(w, rng):
    import gguf

    def matrix(name: str, rows: int, cols: int):
        w.add_tensor(name, _q8_0(rng, rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vector(name: str, n: int, value: float | None = None):
        v = np.full(n, value) if value is not None else 1 + 0.1 * rng.standard_normal(n)
        w.add_tensor(name, v.astype(np.float32))

    return matrix, vector


def _rope_freqs(head_dim: int) -> np.ndarray:
    half = head_dim // 2
    rotated = head_dim // 8  # partial_rotary_factor 0.25: a quarter of each half rotates
    return np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)


def write_target(path: Path, vocab: int, n_layers: int) -> None:
    import gguf

    e, rng = E2B, np.random.default_rng(0)
    pattern = [(i + 1) % 5 != 0 for i in range(n_layers)]
    pattern[-1] = False
    shared = e["shared"] * n_layers // 35  # E2B: the last 20 of 35
    first_shared = n_layers - shared
    ffn = [e["ffn"] * (2 if i >= first_shared else 1) for i in range(n_layers)]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_context_length(4096); w.add_embedding_length(e["hidden"]); w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn); w.add_head_count(e["heads"]); w.add_head_count_kv(e["kv_heads"])
    w.add_rope_freq_base(1e6); w.add_float32("gemma4.rope.freq_base_swa", 1e4)
    w.add_layer_norm_rms_eps(1e-6); w.add_key_length(e["global_head_dim"]); w.add_value_length(e["global_head_dim"])
    w.add_uint32("gemma4.attention.key_length_swa", e["head_dim"])
    w.add_uint32("gemma4.attention.value_length_swa", e["head_dim"])
    w.add_final_logit_softcapping(30.0); w.add_sliding_window(e["window"]); w.add_shared_kv_layers(shared)
    w.add_uint32("gemma4.embedding_length_per_layer_input", e["per_layer"])
    w.add_array("gemma4.attention.sliding_window_pattern", pattern)
    w.add_rope_dimension_count(e["global_head_dim"]); w.add_uint32("gemma4.rope.dimension_count_swa", e["head_dim"])
    w.add_tokenizer_model("gemma4")
    w.add_token_list([f"t{i}" for i in range(vocab)]); w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab); w.add_bos_token_id(2); w.add_eos_token_id(1)
    matrix, vector = _writer_helpers(w, rng)
    h, pl = e["hidden"], e["per_layer"]
    w.add_tensor("rope_freqs.weight", _rope_freqs(e["global_head_dim"]))
    matrix("token_embd.weight", vocab, h)
    matrix("per_layer_token_embd.weight", vocab, n_layers * pl)
    matrix("per_layer_model_proj.weight", n_layers * pl, h)
    vector("per_layer_proj_norm.weight", pl)
    vector("output_norm.weight", h)
    for i in range(n_layers):
        p, hd = f"blk.{i}.", e["head_dim"] if pattern[i] else e["global_head_dim"]
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            vector(p + name + ".weight", h)
        vector(p + "layer_output_scale.weight", 1, 0.5)
        vector(p + "attn_q_norm.weight", hd)
        matrix(p + "attn_q.weight", e["heads"] * hd, h)
        matrix(p + "attn_output.weight", h, e["heads"] * hd)
        if i < first_shared:
            vector(p + "attn_k_norm.weight", hd)
            matrix(p + "attn_k.weight", e["kv_heads"] * hd, h)
            matrix(p + "attn_v.weight", e["kv_heads"] * hd, h)
        matrix(p + "ffn_gate.weight", ffn[i], h)
        matrix(p + "ffn_up.weight", ffn[i], h)
        matrix(p + "ffn_down.weight", h, ffn[i])
        matrix(p + "inp_gate.weight", pl, h)
        matrix(p + "proj.weight", h, pl)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def write_assistant(path: Path, vocab: int) -> None:
    import gguf

    e, a, rng = E2B, ASSISTANT, np.random.default_rng(1)
    n, h = a["layers"], a["hidden"]
    pattern = [True] * (n - 1) + [False]
    w = gguf.GGUFWriter(str(path), "gemma4-assistant")
    w.add_context_length(4096); w.add_embedding_length(h)
    w.add_uint32("gemma4-assistant.embedding_length_out", e["hidden"])
    w.add_block_count(n); w.add_uint32("gemma4-assistant.nextn_predict_layers", n); w.add_shared_kv_layers(n)
    w.add_feed_forward_length(a["ffn"]); w.add_head_count(a["heads"]); w.add_head_count_kv([e["kv_heads"]] * n)
    w.add_key_length(e["global_head_dim"]); w.add_value_length(e["global_head_dim"])
    w.add_uint32("gemma4-assistant.attention.key_length_swa", e["head_dim"])
    w.add_uint32("gemma4-assistant.attention.value_length_swa", e["head_dim"])
    w.add_rope_dimension_count(e["global_head_dim"])
    w.add_uint32("gemma4-assistant.rope.dimension_count_swa", e["head_dim"])
    w.add_rope_freq_base(1e6); w.add_float32("gemma4-assistant.rope.freq_base_swa", 1e4)
    w.add_sliding_window(e["window"]); w.add_array("gemma4-assistant.attention.sliding_window_pattern", pattern)
    w.add_layer_norm_rms_eps(1e-6)
    matrix, vector = _writer_helpers(w, rng)
    w.add_tensor("rope_freqs.weight", _rope_freqs(e["global_head_dim"]))
    matrix("token_embd.weight", vocab, h)
    vector("output_norm.weight", h)
    matrix("nextn.pre_projection.weight", h, 2 * e["hidden"])
    matrix("nextn.post_projection.weight", e["hidden"], h)
    n_centroids = max(1, vocab // 128)
    w.add_tensor("masked_embd_centroids.weight", (0.05 * rng.standard_normal((n_centroids, h))).astype(np.float32))
    w.add_tensor("masked_embd_ordering", rng.permutation(vocab).astype(np.float32))
    for i in range(n):
        p, hd = f"blk.{i}.", e["head_dim"] if pattern[i] else e["global_head_dim"]
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            vector(p + name + ".weight", h)
        vector(p + "layer_output_scale.weight", 1, 0.5)
        vector(p + "attn_q_norm.weight", hd)
        matrix(p + "attn_q.weight", a["heads"] * hd, h)
        matrix(p + "attn_output.weight", h, a["heads"] * hd)
        matrix(p + "ffn_gate.weight", a["ffn"], h)
        matrix(p + "ffn_up.weight", a["ffn"], h)
        matrix(p + "ffn_down.weight", h, a["ffn"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def note(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def speedup(a: float, k: int, curve: dict[int, float], r: float) -> float:
    """Tokens per round over round cost (in target steps) for k drafts at per-position acceptance a."""
    tokens = sum(a ** j for j in range(k + 1))
    return tokens / (curve[k + 1] + k * r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--layers", type=int, default=35, help="target layers (a multiple of 5)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="tokens in the target's cache before each step")
    args = parser.parse_args()

    folder = outrider_home() / "bench" / f"gemma4-e2b-synthetic-v{args.vocab}-l{args.layers}"
    folder.mkdir(parents=True, exist_ok=True)
    target_path, assistant_path = folder / "target.gguf", folder / "assistant.gguf"
    note(f"files under {folder}")
    if not target_path.is_file():
        write_target(target_path.with_suffix(".tmp"), args.vocab, args.layers)
        target_path.with_suffix(".tmp").rename(target_path)
    if not assistant_path.is_file():
        write_assistant(assistant_path.with_suffix(".tmp"), args.vocab)
        assistant_path.with_suffix(".tmp").rename(assistant_path)

    note("loading the target")
    model = CPUBackend().load_model(GGUFFile(target_path))
    note("prefill")
    cache = model.new_cache(args.prompt + args.max_k + 2)
    prompt = torch.randint(0, args.vocab, (args.prompt,))
    _, hidden = model.forward(prompt, 0, cache, hidden=True, last_only=True)
    token = torch.tensor([7])

    def target_step():
        model.forward(token, args.prompt, cache)
        cache.truncate(args.prompt)

    note("target steps")
    step = median_seconds(target_step, args.reps)
    layers = target_kv_layers(model)
    kv = {kind: cache.read(i, args.prompt) for kind, i in layers.items()}
    a_file = GGUFFile(assistant_path)
    ratios = {}
    for head in ("dense", "centroids"):
        note(f"assistant steps, {head} head")
        assistant = Gemma4Assistant(a_file, head=head, centroid_top_k=ASSISTANT["top_k"])
        rows = lambda: assistant.input_rows(model.embed(token), hidden[-1:])
        ratios[head] = median_seconds(lambda: assistant.forward(rows(), args.prompt, kv), args.reps) / step
    note("verify cost curve")
    curve = forward_cost_curve(model, range(1, args.max_k + 2), prompt_len=args.prompt, reps=args.reps)

    print(f"synthetic E2B-shaped pair: vocab {args.vocab}, {args.layers} target layers, threads "
          f"{torch.get_num_threads()}; medians of {args.reps}\n")
    print(f"target decode step: {step * 1e3:.1f} ms")
    for head, r in ratios.items():
        print(f"assistant step per drafted token, {head} head: {r * step * 1e3:.2f} ms = {r:.3f} of a target step")
    print("\nverify cost c(k)/c(1), one target forward over k tokens:\n")
    print("| k | " + " | ".join(str(k) for k in curve) + " |")
    print("|---|" + "---|" * len(curve))
    print("| c(k)/c(1) | " + " | ".join(f"{c:.2f}" for c in curve.values()) + " |")
    for head, r in ratios.items():
        print(f"\nspeed-up over plain decoding ({head} head), best k per acceptance a:\n")
        print("| a | best k | speed-up |")
        print("|---|---|---|")
        for a in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
            k, s = max(((k, speedup(a, k, curve, r)) for k in range(1, args.max_k + 1)), key=lambda x: x[1])
            print(f"| {a:.1f} | {k} | {s:.2f}x |")
        grid = [i / 1000 for i in range(1001)]
        pays = next((a for a in grid if max(speedup(a, k, curve, r) for k in range(1, args.max_k + 1)) > 1), None)
        print(f"\nit pays (speed-up > 1 at the best k) from acceptance a = {pays:.3f}" if pays is not None
              else "\nit never pays on this machine")


if __name__ == "__main__":
    main()
