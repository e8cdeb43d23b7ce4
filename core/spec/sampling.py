"""Sampling: warpers and inverse-CDF sampling (the draws come from `outrider.spec.random_streams`).

The rules are docs/acceptance.md's; what they fix for this module:

* :func:`warp` turns logits into the distribution that is actually sampled from (temperature, then
  top-k, then top-p, then min-p). The same function is applied to the target (p) and to the drafter (q).
  The repeat, presence and frequency penalties are not part of it: they depend on the context, and are
  applied to the target's logits before it (:mod:`outrider.spec.penalties`).
* :class:`~outrider.spec.random_streams.PositionRandom` gives one uniform draw per absolute sequence
  position, so that plain decoding (``sample_at(warp(logits_n), rng.uniform(n))``) and speculative decoding
  with a deterministic drafter produce the same tokens for the same seed.
* :func:`sample_at` picks token i iff cum[i-1] <= u * total < cum[i] over the row in vocabulary order,
  so the same draw gives the same token wherever it is made.
* :func:`sample_logits` is ``sample_at(warp(logits, params), u)`` for one row of logits, without warping the
  whole vocabulary (the CPU kernels' sampler): plain decoding and every deterministic drafter's round draw
  through it, so they agree token for token.

The acceptor protocol (one verify round, the result) is in :mod:`outrider.spec.acceptance`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outrider.errors import ConfigError

__all__ = [
    "SamplingParams",
    "warp",
    "sample_at",
    "sample_logits",
    "sample_rows",
    "argmax",
    "argmax_token",
]


# ----------------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------------


GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as vLLM's _SAMPLING_EPS: no float32 softmax samples at 1e-40


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled. A temperature of 0 (or below GREEDY_BELOW) means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # None = pick one at random (PositionRandom reports it)
    min_p: float = 0.0  # 0 = off; keeps tokens with p >= min_p * p_max, p after temperature (transformers', vLLM's)
    # llama.cpp's penalties over the last `repeat_last_n` tokens of the context (-1: all of it, 0: none)
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m <= 1.0):
            raise ConfigError(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        r = self.repeat_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ConfigError(f"repeat_penalty must be a finite number > 0 (1 = off), got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number (0 = off), got {v!r}")
        n = self.repeat_last_n
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < -1:
            raise ConfigError(f"repeat_last_n must be an integer >= -1 (-1 = the whole context, 0 = off), got {n!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0):
            raise ConfigError(f"seed must be an integer >= 0 (or unset for a random one), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """Whether the penalties change any logit: otherwise no penalty work is done at all."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)


# ----------------------------------------------------------------------------------------------------------
# Warping
# ----------------------------------------------------------------------------------------------------------


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] (float32, rows sum to 1) after temperature, top-k, top-p, then min-p.

    At temperature 0 the result is the one-hot of the argmax (first index on ties). Top-k keeps exactly
    ``top_k`` tokens; top-p keeps the smallest set of most probable tokens (among those top-k kept) whose
    mass is >= ``top_p``, always at least one; min-p then keeps, of those, the tokens whose probability is
    >= ``min_p`` times the largest. Every filter sees the tempered distribution, as in transformers and vLLM
    (llama.cpp's default chain filters before temperature: at T != 1 its sets differ). Batched over the leading dimensions; each row comes
    out the same whether it is warped alone or in a batch.
    """
    x = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
    if params.greedy:  # the argmax survives every filter
        idx = argmax(x).unsqueeze(-1)
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    x = x / float(params.temperature)
    probs = _top_k_top_p(x, params)
    if params.min_p > 0.0:
        probs = _keep_min_p(x, probs, params.min_p)
    return probs


def _top_k_top_p(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    vocab = x.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else 0
    if k == 0 and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    if k == 0:
        return _nucleus(x, params.top_p)
    vals, idx = torch.topk(x, k, dim=-1, largest=True, sorted=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return torch.zeros_like(x).scatter_(-1, idx, probs)


def _keep_min_p(logits: torch.Tensor, probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """`probs` without the tokens whose probability is below min_p times the largest, renormalised:
    p_i >= min_p * p_max is logit_i >= max_logit + log(min_p) for the tempered `logits`. The
    argmax always passes, and top-k and top-p keep it too, so a row never empties."""
    keep = logits >= logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities in descending order -> the top-p prefix renormalised, zeros after it."""
    cum = torch.cumsum(probs, dim=-1)
    before = cum - probs  # mass of the strictly more probable tokens
    keep = before < top_p
    keep[..., 0] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


_SORT_WHOLE_ROWS_BELOW = 2048  # a toy vocabulary: torch's sort is quick and the way below costs more calls


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over the whole vocabulary, as if by a stable descending sort of every row, without that sort.

    The probabilities must be the softmax of the SORTED row: its float32 sum runs in that order, and a sum
    in another order (a top-k window, the unsorted row) moves results by an ulp. Only the values need
    sorting for that, and numpy sorts float32 values without indices ~15x faster than torch's stable sort
    with them. The indices are needed only for the kept tokens: every token >= the last kept value, put in
    stable order (value descending, then index), which is the full stable sort's prefix.
    """
    if x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] < _SORT_WHOLE_ROWS_BELOW:
        return _nucleus_by_full_sort(x, top_p)
    rows = x.detach().reshape(-1, x.shape[-1])
    values = rows.numpy()
    vals = torch.from_numpy(np.ascontiguousarray(np.sort(values, axis=-1)[:, ::-1]))
    probs = _keep_top_p(torch.softmax(vals, dim=-1), top_p).numpy()
    out = np.zeros_like(values)
    for r in range(rows.shape[0]):
        kept = np.flatnonzero(probs[r])  # positions in sorted order: a prefix, but for rounding at its end
        if kept.size == 0:
            return _nucleus_by_full_sort(x, top_p)  # NaN rows: keep the reference behaviour
        last = int(kept[-1])
        row = values[r]
        candidates = np.flatnonzero(row >= vals[r, last].item())
        if candidates.size < last + 1:  # NaN compares false: the reference handles it
            return _nucleus_by_full_sort(x, top_p)
        order = np.argsort(-row[candidates], kind="stable")  # ties keep index order, as the stable sort does
        out[r, candidates[order[: last + 1]][kept]] = probs[r, kept]
    return torch.from_numpy(out).reshape(x.shape)


def _nucleus_by_full_sort(x: torch.Tensor, top_p: float) -> torch.Tensor:
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return torch.zeros_like(x).scatter_(-1, idx, _keep_top_p(torch.softmax(vals, dim=-1), top_p))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the maximum over the last dimension (int64 [...]): the first on ties, a NaN counts as the maximum.

    torch.argmax's reduction costs ~0.3 ms on a 262k-wide float32 row; numpy's ~0.02 ms, same answer.
    """
    if _numpy_can_read(x):
        return torch.as_tensor(np.argmax(x.detach().numpy(), axis=-1), dtype=torch.long)
    return x.argmax(dim=-1)


def argmax_token(row: torch.Tensor) -> int:
    """:func:`argmax` of one row [V] as a Python int."""
    if _numpy_can_read(row):
        return int(np.argmax(row.detach().numpy()))
    return int(row.argmax())


def _numpy_can_read(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64, torch.float16) and x.dim() > 0


# ----------------------------------------------------------------------------------------------------------
# Inverse-CDF sampling
# ----------------------------------------------------------------------------------------------------------


def sample_rows(probs: torch.Tensor, us: Sequence[float]) -> list[int]:
    """Inverse-CDF sample of each row of ``probs`` [N, V] with its own ``us[n]`` in [0, 1).

    Token i is chosen iff cum[i-1] <= u * total < cum[i] (vocabulary order, float64, summed left to right),
    so a token of zero probability is never chosen; u * total rounding up to total falls back to the last
    token with nonzero probability. Rows need not be normalised. Row n gives the same token as
    ``sample_at(probs[n], us[n])``.
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_rows expects [N, V] probabilities, got shape {tuple(probs.shape)}")
    n = probs.shape[0]
    if len(us) != n:
        raise ValueError(f"{n} rows but {len(us)} uniforms")
    if n == 0:
        return []
    if n == 1 and probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64, torch.float16):
        return [_sample_row(probs[0].detach().numpy(), float(us[0]))]
    p = probs.detach().to(torch.float64)
    cum = torch.cumsum(p, dim=-1)
    total = cum[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()) or bool((p < 0).any()):
        raise ValueError(_CANNOT_SAMPLE)
    u = torch.tensor(list(us), dtype=torch.float64, device=p.device).unsqueeze(-1)
    idx = torch.searchsorted(cum, u * total, right=True).squeeze(-1).tolist()
    vocab = p.shape[-1]
    for r, i in enumerate(idx):
        if i >= vocab:
            idx[r] = int(torch.nonzero(p[r] > 0)[-1])
    return idx


_CANNOT_SAMPLE = "cannot sample: a row of probabilities is all zero, negative or not finite"


def _sample_row(row: np.ndarray, u: float) -> int:
    """One row of :func:`sample_rows`, summing only the nonzero entries.

    Zeros add nothing to a float64 running sum, so the cumulative values at the nonzero entries (and the
    total) are the same bits as over the whole row, and the first one above u * total is the same token;
    a top-p row is a few hundred entries, not the vocabulary.
    """
    support = np.flatnonzero(row)
    values = row[support]
    cum = np.cumsum(values, dtype=np.float64)  # sequential, as torch.cumsum is
    total = float(cum[-1]) if cum.size else 0.0
    if not (total > 0 and math.isfinite(total)) or bool((values < 0).any()):
        raise ValueError(_CANNOT_SAMPLE)
    i = int(np.searchsorted(cum, u * total, side="right"))
    return int(support[min(i, support.size - 1)])  # u * total rounded up to total: the last nonzero token


def sample_at(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of ``probs`` [V] with the uniform ``u`` in [0, 1) (see :func:`sample_rows`)."""
    return sample_rows(probs.reshape(1, -1), [u])[0]


_KERNEL_FROM_VOCAB = 4096  # below, warping the row in torch costs less than the call's own overhead


def sample_logits(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token ``sample_at(warp(logits, params), u)`` gives, for one row of logits [V].

    On the CPU the kernels' sampler finds it without warping the row: the filters look only at tokens near
    the largest logit and the draw sums exps by blocks (warping a 262k-token row in torch costs a large share
    of a small model's decode step: docs/bench/cpu.md). Its sums run in float64 over float32 exps in another
    order than the reference's, so it can pick another token only where rounding decides (u * total within
    rounding of a boundary between two tokens, or a token's mass before it within rounding of top_p); the law
    is the same. Rows it cannot decide (NaN, infinities) go to the reference, which says what is wrong.
    """
    if params.greedy:
        return argmax_token(logits)
    kernels = _sampler_kernels() if logits.shape[-1] >= _KERNEL_FROM_VOCAB else None
    if kernels is not None and logits.device.type == "cpu" and logits.dim() == 1:
        row = logits.detach()
        row = row if row.dtype == torch.float32 and row.is_contiguous() else row.to(torch.float32).contiguous()
        token = kernels.sample_logits(row, float(params.temperature), int(params.top_k), float(params.top_p),
                                      float(params.min_p), float(u))
        if token >= 0:
            return token
    return sample_at(warp(logits, params), u)


@functools.cache
def _sampler_kernels():
    """The CPU kernels module, or None where it cannot be built (the reference then decides every draw): asked
    once, not per draw."""
    from outrider.native import NativeUnavailable, load

    try:
        return load()
    except NativeUnavailable:
        return None
