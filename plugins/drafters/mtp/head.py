"""The MTP head, in its two forms: `MTPHead` drafts (the backend's kernels, a KV cache per sequence, no gradients)
and `TrainableHead` is what `outrider distill` trains (parameters, whole sequences, gradients). Both are
one forward, `mtp_rows`: the token's embedding and the target's previous hidden state, each RMS-normed,
concatenated and projected (eh_proj), one decoder block of the trunk's kind (`decoder_layer`, or the native
stack that matches it), the head's norm. tests/test_mtp.py checks that the two give the same rows."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import numpy as np
import torch

from outrider.errors import ModelFileError
from outrider.io.gguf import GGUFFile
from outrider.models.gemma3 import local_layers
from outrider.models.linear import StackedLinear, rms_norm, torch_post_steps
from outrider.models.llama import unpermute_qk
from outrider.models.stack import LayerStack, LayerWeights, decoder_layer
from outrider.models.weight_forms import load_linear
from outrider.native import cpu_flags
from outrider.spec.drafter import Target

QKV_BIAS = "attn_qkv_bias"  # TrainableHead's name for Qwen2's q, k and v biases, kept as one parameter
NEXTN_NAMES = ("eh_proj", "enorm", "hnorm", "shared_head_norm", "shared_head_head")  # blk.{b}.nextn.* in the file


def mtp_rows(embedded: torch.Tensor, hidden: torch.Tensor, enorm: torch.Tensor, hnorm: torch.Tensor, eh_proj,
             block: Callable[[torch.Tensor], torch.Tensor], head_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """The head's post-norm hidden rows h' = rms(block(eh_proj([rms(E[x_p], enorm), rms(h_{p-1}, hnorm)])))."""
    x = torch.cat([rms_norm(embedded, enorm, eps), rms_norm(hidden, hnorm, eps)], dim=-1)
    return rms_norm(block(eh_proj(x)), head_norm, eps)


PRECISIONS = ("auto", "bf16", "fp32")  # of training's matrix products (`TrainableHead.train_step`)


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), where training under bfloat16
    autocast takes less time a step (docs/bench/mtp.md); elsewhere bfloat16 products are converted, not faster."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()))


# under bfloat16 autocast the norms meet bfloat16 rows and float32 weights and take torch's unfused path, which
# is what is meant; set once here (not per call: the filters are process-wide, and the learner may run on any thread)
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


def target_logits(hidden: torch.Tensor, rows: torch.Tensor, softcap: float) -> torch.Tensor:
    """The target's logits over the draft vocabulary: its final-normed hidden states through its own output rows
    there (`model.output.rows(vocab_ids)`), softcapped as its head is."""
    return torch_post_steps(hidden.float() @ rows.T, None, None, softcap, 0.0)


def shifted(hidden: torch.Tensor) -> torch.Tensor:
    """h_{p-1} for every row p (a zero row before position 0, as the drafter does)."""
    return torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])


class MTPHead:
    """One MTP block: the trunk-kind decoder block and the nextn projections around it, on the target's
    backend. It holds weights only: every sequence it drafts for brings its own one-layer KV cache
    (`new_cache`), so one head serves interleaved sequences and a rebuilt head takes over their caches."""

    def __init__(self, g: GGUFFile, b: int, target: Target, max_len: int):
        """`max_len`: the positions a cache from `new_cache` holds."""
        model = target.model
        self.model, self.eps, self.max_len = model, model.config.eps, max_len
        dtype, device, packed = model.dtype, model.device, model.native
        p = f"blk.{b}.nextn."
        has = lambda name: p + name + ".weight" in g.tensors
        norm = lambda name: g.load(p + name + ".weight").to(dtype).to(device)
        for name in ("eh_proj", "enorm", "hnorm"):
            if not has(name):
                raise ModelFileError(f"{g.path}: MTP block {b} lacks {p}{name}.weight; the file is not an MTP head")
        self.eh_proj = load_linear(g, [p + "eh_proj.weight"], packed, dtype, device)
        self.enorm, self.hnorm = norm("enorm"), norm("hnorm")
        self.head_norm = norm("shared_head_norm") if has("shared_head_norm") else model.output_norm
        self.embed_table = norm("embed_tokens") if has("embed_tokens") else None
        self.softcap = model.logit_softcap
        self.ids = None  # reduced draft vocabulary: row r of the head is target token ids[r]
        if has("shared_head_head"):
            self.head = load_linear(g, [p + "shared_head_head.weight"], packed, dtype, device)
            rows = g.tensors[p + "shared_head_head.weight"].shape[0]
            if p + "draft_vocab" in g.tensors:
                ids = np.frombuffer(g.raw(p + "draft_vocab"), dtype=np.int32)
                self.ids = torch.from_numpy(ids.astype(np.int64))
                if len(ids) != rows or int(ids.max()) >= model.config.vocab_size or int(ids.min()) < 0:
                    raise ModelFileError(f"{g.path}: {p}draft_vocab must hold {rows} target ids below "
                                         f"{model.config.vocab_size}; rewrite it with `outrider distill`")
            elif rows != model.config.vocab_size:
                raise ModelFileError(f"{g.path}: {p}shared_head_head has {rows} rows, the target's vocabulary "
                                     f"{model.config.vocab_size}, and no {p}draft_vocab maps them")
        else:
            self.head = model.output
        self.stack = LayerStack([model.block(g, b)], model.attention, self.eps, model.activation)

    def new_cache(self):
        """An empty one-layer KV cache of `max_len` positions, for one sequence's rows of this head (or of any
        head of the same block kind: a rebuilt head reads the rows an earlier one made)."""
        return self.model.attention.new_cache(1, self.max_len, self.model.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_table[tokens] if self.embed_table is not None else self.model.embed(tokens)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, cache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the last row over the head's rows, post-norm hidden [T, H]) for rows at start..start+T-1,
        their keys and values written to `cache` (one sequence's, from `new_cache`; it holds rows [0, start))."""
        block = lambda x: self.stack.run(x, start, cache, False)
        h = mtp_rows(self.embed(tokens), hidden.to(self.enorm.dtype), self.enorm, self.hnorm, self.eh_proj, block,
                     self.head_norm, self.eps)
        cache.length = start + tokens.shape[0]
        return self.head(h[-1:], softcap=self.softcap)[0].float(), h

    def full_logits(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        if self.ids is None:
            return logits[:vocab].cpu()
        full = torch.full((vocab,), float("-inf"))
        return full.scatter_(0, self.ids, logits.cpu())


class TrainableHead(torch.nn.Module):
    """The MTP block as trainable parameters, run over whole sequences without a cache: `mtp_rows` and
    `decoder_layer` with attention over the rows themselves (and, chained, the shallower drafts' rows:
    `Attention.over_chain`), in differentiable
    torch. `MTPHead` runs the same two functions on the backend's kernels."""

    def __init__(self, model, g, vocab_ids: torch.Tensor):
        super().__init__()
        cfg = model.config
        self.arch, self.cfg = model.architecture, cfg
        self.model, self.vocab_ids = model, vocab_ids
        self.eps = cfg.eps
        last = cfg.n_layers - 1
        load = lambda name: g.load(f"blk.{last}.{name}.weight").float()
        # on the target's device: the inputs (its hidden rows, embeddings, rotary tables) live there
        param = lambda t: torch.nn.Parameter(t.float().to(model.device, copy=True))
        hidden = cfg.hidden_size
        q, k = load("attn_q"), load("attn_k")
        if self.arch == "llama":
            q, k = unpermute_qk(cfg.n_heads)(q), unpermute_qk(cfg.n_kv_heads)(k)
        self.w = torch.nn.ParameterDict({
            "attn_norm": param(load("attn_norm")), "ffn_norm": param(load("ffn_norm")),
            "attn_q": param(q), "attn_k": param(k), "attn_v": param(load("attn_v")),
            "attn_output": param(load("attn_output")), "ffn_gate": param(load("ffn_gate")),
            "ffn_up": param(load("ffn_up")), "ffn_down": param(load("ffn_down")),
            # the hidden part starts as the identity: the head begins as "the trunk's last layer, once more"
            "eh_proj": param(torch.cat([0.1 * torch.eye(hidden), torch.eye(hidden)], dim=1)),
            "enorm": param(torch.ones(hidden)), "hnorm": param(torch.ones(hidden)),
            "shared_head_norm": param(model.output_norm.float()),
            "shared_head_head": param(model.output.rows(vocab_ids).float()),
        })
        opt = lambda name: self.w[name] if name in self.w else None
        for name in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):  # Gemma 3, Qwen3
            if f"blk.{last}.{name}.weight" in g.tensors:
                self.w[name] = param(load(name))
        if f"blk.{last}.attn_q.bias" in g.tensors:  # Qwen2: one fused q/k/v bias, as the trunk's layers add it
            self.w[QKV_BIAS] = param(torch.cat([g.load(f"blk.{last}.attn_{n}.bias") for n in "qkv"]))
        if self.arch == "gemma3":
            # block n_layers, local or global as the drafter reads it
            rotary, window = model.position(local_layers(g, cfg.n_layers + 1)[cfg.n_layers])
        else:
            rotary, window = model.rotary, None
        w, lin = self.w, lambda *names: StackedLinear(*(self.w[n] for n in names))
        # the block as the trunk's layers are held, on the parameters (q, k, v and gate, up trained apart)
        self.layer = LayerWeights(lin("attn_q", "attn_k", "attn_v"), lin("attn_output"), lin("ffn_gate", "ffn_up"),
                                  lin("ffn_down"), w["attn_norm"], w["ffn_norm"], rotary, window, opt("attn_q_norm"),
                                  opt("attn_k_norm"), opt("post_attention_norm"), opt("post_ffw_norm"),
                                  opt(QKV_BIAS))
        self.eh_proj, self.head = lin("eh_proj"), lin("shared_head_head")
        # the output rows stay the target's (EAGLE keeps its LM head frozen too): the head learns to give
        # hidden states the target's own head reads, and a step trains a fifth fewer weights
        self.w["shared_head_head"].requires_grad_(False)
        self.softcap = model.logit_softcap

    @classmethod
    def from_sidecar(cls, model, g, sidecar: GGUFFile) -> "TrainableHead":
        """The head a sidecar written by `outrider distill` holds, as parameters again (to train further)."""
        b = model.config.n_layers
        p = f"blk.{b}."
        if p + "nextn.draft_vocab" not in sidecar.tensors or p + "nextn.shared_head_head.weight" not in sidecar.tensors:
            raise ModelFileError(f"{sidecar.path}: not a head `outrider distill` wrote (no {p}nextn.draft_vocab); "
                                 "only such a head can keep training")
        ids = torch.from_numpy(np.frombuffer(sidecar.raw(p + "nextn.draft_vocab"), dtype=np.int32).astype(np.int64))
        head = cls(model, g, ids)
        cfg = model.config
        with torch.no_grad():
            for name, param in head.w.items():
                if name == QKV_BIAS:
                    t = torch.cat([sidecar.load(f"{p}attn_{n}.bias") for n in "qkv"])
                else:
                    t = sidecar.load(p + ("nextn." if name in NEXTN_NAMES else "") + name + ".weight")
                    if head.arch == "llama" and name in ("attn_q", "attn_k"):
                        t = unpermute_qk(cfg.n_heads if name == "attn_q" else cfg.n_kv_heads)(t)
                param.copy_(t.reshape(param.shape))
        return head

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters training moves (the output rows stay the target's), in a fixed order."""
        return [p for p in self.parameters() if p.requires_grad]

    def optimizer(self, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
        """AdamW over the trained parameters, fused: the unfused update walks every parameter a dozen times, which
        on a CPU costs more than the step's forward and backward together (docs/bench/mtp.md)."""
        return torch.optim.AdamW(self.trained_parameters(), lr=lr, weight_decay=weight_decay, fused=True)

    def train_step(self, optimizer: torch.optim.Optimizer, loss_of: Callable[[], tuple], precision: str = "auto"
                   ) -> tuple:
        """One optimizer step on the loss `loss_of()` returns first (the rest of what it returns is returned): its
        matrix products under bfloat16 autocast with `precision` bf16, or auto where the head trains on a CPU that
        multiplies bfloat16 (`cpu_has_bf16_matmul`), the parameters float32 either way; gradients clipped to norm 1."""
        device = self.w["eh_proj"].device.type  # the target's: on a GPU, auto trains in float32
        bf16 = precision == "bf16" or (precision == "auto" and device == "cpu" and cpu_has_bf16_matmul())
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss, *rest = loss_of()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        optimizer.step()
        return tuple(rest)

    def loss(self, tokens: torch.Tensor, h_prev: torch.Tensor, hidden: torch.Tensor, want_p: torch.Tensor,
             want_ids: torch.Tensor | None = None, feature_weight: float = 0.0, depth: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, KL, feature term) of the first draft, averaged over rows; with `depth` > 1 the loss is also
        the deeper drafts' (`chain`), depth d weighted 0.8^(d-1) as EAGLE-3 weighs them. Row p's targets at
        every depth are the target's distribution of x_{p+1} (`want_p` over the draft vocabulary's rows
        `want_ids`, or over all of it; the loss takes the soft cross-entropy, the KL up to a constant) and the
        target's own hidden state h_p = hidden[p] (smooth L1, EAGLE's feature term: when the head chains, its
        h' stands in for h_p at the next row)."""
        entropy = -(want_p * want_p.clamp_min(1e-12).log()).sum(-1)
        total, weights = 0.0, 0.0
        for d, (logits, h) in enumerate(self.chain(tokens, h_prev, min(max(depth, 1), len(tokens)))):
            logq = torch.log_softmax(logits[d:], -1)  # rows before d seed no chain this deep
            if want_ids is not None:
                logq = logq.gather(1, want_ids[d:])
            ce = -(want_p[d:] * logq).sum(-1).mean()
            feature = torch.nn.functional.smooth_l1_loss(h[d:], hidden[d:])
            if d == 0:
                first_kl_feature = ce - entropy.mean(), feature
            total, weights = total + 0.8 ** d * (ce + feature_weight * feature), weights + 0.8 ** d
        return total / weights, *first_kl_feature

    def chain(self, tokens: torch.Tensor, h_prev: torch.Tensor, depth: int = 1
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(draft-vocabulary logits [T, V_d], post-norm hidden [T, H])] for depths 1..depth. Depth 1's row p is
        (x_p, h_{p-1}); depth d's row p is (x_p, depth d-1's h' of row p - 1): the d-th draft of a chain seeded
        at row p - d + 1 whose earlier drafts were right, as the drafter runs it (`Attention.over_chain`)."""
        with torch.no_grad():
            e = self.model.embed(tokens.to(self.model.device)).float()
        l, attention, w = self.layer, self.model.attention, self.w
        depth_kv = []
        attend = lambda qkv: attention.over_chain(qkv, l.rotary, l.q_norm, l.k_norm, l.window, depth_kv)
        block = lambda x: decoder_layer(l, x, attend, self.eps, self.model.activation)
        depths = []
        for _ in range(depth):
            h = mtp_rows(e, h_prev, w["enorm"], w["hnorm"], self.eh_proj, block, w["shared_head_norm"], self.eps)
            depths.append((self.head(h, softcap=self.softcap), h))
            h_prev = shifted(h)
        return depths

    def forward(self, tokens: torch.Tensor, h_prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocabulary logits [T, V_d], post-norm hidden [T, H]) of rows 0..T-1 = (x_p, h_{p-1})."""
        return self.chain(tokens, h_prev)[0]
