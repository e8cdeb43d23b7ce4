"""llama.cpp's repeat, presence and frequency penalties on the target's logits, row by row under speculation.

For each token t that occurs c > 0 times among the last ``repeat_last_n`` tokens of the context (prompt and
generated; -1: the whole context), its logit l becomes l / repeat_penalty if l > 0 else l * repeat_penalty,
then loses c * frequency_penalty + presence_penalty (llama.cpp's ``llama_sampler_penalties``, the same formula
as OpenAI's presence and frequency penalties). They are applied before :func:`~outrider.spec.sampling.warp`,
at temperature 0 too: they can move the argmax.

A verify round's row i is the target's distribution after t0 and the drafts x_1..x_i, so its penalties count
those drafts as context: each row gets the counts plain decoding would have at that position, and the
acceptor keeps exactly what plain decoding with the penalties would emit.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from outrider.spec.sampling import SamplingParams

__all__ = ["ContextPenalties"]


class ContextPenalties:
    """The context's recent tokens and their counts, kept up to date as tokens become certain, and the
    penalties they put on a round's logits. Only built when ``params.penalizes``."""

    def __init__(self, params: SamplingParams, context: list[int]) -> None:
        self.params = params
        self.window = None if params.repeat_last_n < 0 else params.repeat_last_n
        self.context: list[int] = []
        self.counts: Counter[int] = Counter()
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        """`tokens` are now certain: they join the context, and what falls out of the window leaves the counts."""
        for token in tokens:
            self.context.append(token)
            self.counts[token] += 1
            if self.window is not None and len(self.context) > self.window:
                leaving = self.context[-self.window - 1]
                self.counts[leaving] -= 1
                if not self.counts[leaving]:
                    del self.counts[leaving]

    def apply(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """`logits` [k+1, V] (or [V], one row) of a round over the certain context then `drafts` x_1..x_k,
        penalised: row i as if x_1..x_i were context; `logits` is left as it was (and returned as it is when no
        token is counted)."""
        one_row = logits.dim() == 1
        rows = logits.unsqueeze(0) if one_row else logits
        drafts = [int(x) for x in drafts[: rows.shape[0] - 1]]
        ids = list(self.counts.keys() | set(drafts))
        if not ids:
            return logits
        column = {t: j for j, t in enumerate(ids)}
        counts = np.zeros((rows.shape[0], len(ids)), dtype=np.float32)
        counts[0] = [self.counts.get(t, 0) for t in ids]
        n = len(self.context)
        for i in range(1, rows.shape[0]):
            counts[i] = counts[i - 1]
            counts[i, column[drafts[i - 1]]] += 1
            if self.window is not None:
                # row i's context is n + i tokens long: the one at n + i - 1 - window has just left its window
                leaving = n + i - 1 - self.window
                if leaving >= 0:
                    token = self.context[leaving] if leaving < n else drafts[leaving - n]
                    counts[i, column[token]] -= 1
        index = torch.tensor(ids, dtype=torch.long, device=rows.device)
        c = torch.from_numpy(counts).to(rows.device)
        values = rows[:, index].to(torch.float32)
        p = self.params
        penalised = torch.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
        penalised = penalised - (c * p.frequency_penalty + (c > 0).to(torch.float32) * p.presence_penalty)
        out = rows.to(torch.float32, copy=True)
        out[:, index] = torch.where(c > 0, penalised, values)
        return out[0] if one_row else out
