"""The argmax-stable contract, for backends whose verify passes are not bit-for-bit single steps (the GPU).

The CPU backend's verify pass over k + 1 tokens gives exactly the logits of k + 1 one-token steps, so greedy
speculative decoding emits exactly the tokens of plain greedy decoding. A GPU's kernels pick their tiling,
and so their summation order, by the number of rows: a verify pass moves each logit by some small drift
delta relative to a single step. An argmax can then change only where the top two logits are within
2 * delta of each other. The contract is:

    Greedy speculative output equals plain greedy output up to the first position where they differ, and
    at that position the target's top-2 logit gap (in the plain run) is at most `margin`;
    margin = 2 * the measured verify drift (`verify_drift`), and `near_tie_rate` reports how often plain
    decoding meets such positions at all (the README states both, measured on the GPU).

After the first difference the two continuations are different texts, so nothing after it is compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """[T] float32: the largest logit minus the second largest, per row of [T, vocab]."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def near_tie_rate(gaps: torch.Tensor, margin: float) -> float:
    """Fraction of positions whose top-2 gap is at most `margin`: where the contract allows a difference."""
    return float((gaps <= margin).float().mean()) if gaps.numel() else 0.0


@torch.inference_mode()
def greedy_with_gaps(model, prompt: list[int], n_tokens: int, device=None) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding, one token per forward: (the n_tokens tokens, the top-2 gap behind each)."""
    device = device or getattr(model, "device", "cpu")
    cache = model.new_cache(len(prompt) + n_tokens + 1)
    logits = model.forward(torch.tensor(prompt, device=device), 0, cache, last_only=True)
    tokens, gaps = [], []
    while True:
        row = logits[-1:].float().cpu()
        tokens.append(int(row.argmax()))
        gaps.append(top2_gaps(row)[0])
        if len(tokens) == n_tokens:
            return tokens, torch.stack(gaps)
        logits = model.forward(torch.tensor(tokens[-1:], device=device), len(prompt) + len(tokens) - 1, cache)


@torch.inference_mode()
def verify_drift(model, prefix: torch.Tensor, block: torch.Tensor) -> float:
    """Max |logit| difference between one forward over `block` and len(block) one-token forwards, both after
    `prefix`: the delta of the contract, for this backend, model and shape."""
    start = prefix.shape[0]
    cache_a, cache_b = model.new_cache(start + block.shape[0] + 1), model.new_cache(start + block.shape[0] + 1)
    model.forward(prefix, 0, cache_a)
    model.forward(prefix, 0, cache_b)
    batched = model.forward(block, start, cache_a).float()
    single = torch.cat([model.forward(block[i:i + 1], start + i, cache_b) for i in range(block.shape[0])]).float()
    return float((batched - single).abs().max())


@dataclass(frozen=True)
class Verdict:
    first_difference: int | None  # index of the first differing token, None when equal (over the shorter)
    gap: float | None  # the plain run's top-2 gap there
    margin: float

    @property
    def holds(self) -> bool:
        return self.first_difference is None or (self.gap is not None and self.gap <= self.margin)


def judge(plain: list[int], speculative: list[int], plain_gaps: torch.Tensor, margin: float) -> Verdict:
    """The contract's verdict on one pair of greedy outputs; `plain_gaps[i]` is the gap behind plain[i]."""
    n = min(len(plain), len(speculative))
    first = next((i for i in range(n) if plain[i] != speculative[i]), None)
    if first is None:
        return Verdict(None, None, margin)
    return Verdict(first, float(plain_gaps[first]), margin)


def assert_argmax_stable(plain: list[int], speculative: list[int], plain_gaps: torch.Tensor, margin: float,
                         what: str = "") -> Verdict:
    verdict = judge(plain, speculative, plain_gaps, margin)
    assert verdict.holds, (f"{what}: greedy speculative output differs from plain greedy at token "
                           f"{verdict.first_difference}, where the top-2 logit gap is {verdict.gap:.4g} > margin "
                           f"{margin:.4g}: not a near-tie, so the verify pass is wrong, not merely reordered")
    return verdict
