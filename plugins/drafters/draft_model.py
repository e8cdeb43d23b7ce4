"""The `draft-model` drafter: a smaller GGUF model with the same vocabulary proposes tokens.

Each sequence's state keeps the draft model's own KV cache of it, rolled back with the target's (the caches
are pooled: a finished sequence's is the next one's). `head_rows = N` drafts from the first N rows of
its output head only, with every control and user-defined token (FR-Spec's frequency-ranked draft head:
a byte-level BPE vocabulary's ids follow its merges, most frequent first, and a small draft model's head
is a third of the bytes it reads a token); a token outside them is never drafted, so only acceptance can
change, never the output. By default it drafts by argmax
(deterministic, so the sampled acceptor uses the one-hot rule and a seeded run reproduces plain
sampling exactly); with `sample = true` it samples from its own warped distribution q and
reports q, for the Leviathan full-q rule. A draft ends where the draft model's largest probability falls
below `p_min` (llama.cpp's --draft-p-min rule, on by default here; --draft-p-min wins where given): whether a
position is drafted depends on its q row only, so both acceptors stay lossless.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from outrider import native
from outrider.catalog import resolve_model
from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.io.gguf import GGUFFile, stored_weight_bytes
from outrider.io.tokenizer import Tokenizer, TokenType
from outrider.models.layers import trunk_layers
from outrider.models.weight_forms import load_linear
from outrider.spec.drafter import (NEEDS_DRAFT_MODEL, Draft, DraftControls, DrafterBase, DraftKind, DraftState,
                                   DraftStepClock, Target, draft_position)
from outrider.spec.sampling import SamplingParams

# llama.cpp's rule: ids below this may differ (special tokens), the rest must spell the same.
_SPECIAL_PREFIX = 5
_MAX_VOCAB_SIZE_DIFFERENCE = 128
# The draft's own confidence stop where --draft-p-min is not given: a draft model of the target's family is
# rarely wrong where it is sure and often where it is not, and each token drafted costs a draft step and a
# verify row whether it is kept or not (docs/bench/qwen-pair.md: what a round of the AVX2 path costs).
DEFAULT_P_MIN = 0.75


def check_vocab_compatible(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    fix = "pick a draft model from the same family as the target (same tokenizer)"
    if abs(target.vocab_size - draft.vocab_size) > _MAX_VOCAB_SIZE_DIFFERENCE:
        raise ConfigError(f"draft model {draft_name} has {draft.vocab_size} tokens, the target {target.vocab_size}; {fix}")
    if (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        raise ConfigError(f"draft model {draft_name} has different BOS/EOS ids than the target; {fix}")
    for i in range(_SPECIAL_PREFIX, min(target.vocab_size, draft.vocab_size)):
        if target.tokens[i] != draft.tokens[i]:
            raise ConfigError(f"draft model {draft_name} spells token {i} {draft.tokens[i]!r}, the target "
                              f"{target.tokens[i]!r}; {fix}")


@dataclass
class DraftModelState(DraftState):
    cache: Any = None  # the draft model's KV cache of this sequence
    unread: int = 0  # prompt tokens the draft model has yet to read (at the sequence's first draft)


class DraftModelDrafter(DrafterBase):
    State = DraftModelState
    needs = frozenset({NEEDS_DRAFT_MODEL})
    gives_draft_probs = False  # True on an instance made with sample = true; assembly reads the instance
    drafts_in_lockstep = True  # propose_many: one draft-model forward a position for every sequence

    def __init__(self, model: str = "", sample: bool = False, context: int = 4096, dtype: str = "",
                 activations: str = "", threads: int = 0, head_rows: int = 0, p_min: float = DEFAULT_P_MIN,
                 step_cost: float = 0.0):
        if not model:
            raise ConfigError("drafter 'draft-model' needs a model: pass --draft-model NAME|PATH")
        if head_rows < 0:
            raise ConfigError(f"drafter 'draft-model': head_rows = {head_rows}; give 0 (the whole head) or more")
        if not 0.0 <= p_min < 1.0:
            raise ConfigError(f"drafter 'draft-model': p_min = {p_min}; give a probability in [0, 1), 0 = off")
        if step_cost < 0.0:
            raise ConfigError(f"drafter 'draft-model': step_cost = {step_cost}; give a share of a target step, 0 = "
                              "from the files")
        self.head_rows, self.p_min, self.step_cost = head_rows, p_min, step_cost
        if activations:
            native.check_activations_mode(activations)
        self.model_name, self.sample, self.context, self.dtype = model, sample, context, dtype
        self.activations, self.threads = activations, threads
        self.gives_draft_probs = sample

    def setup(self, target: Target) -> None:
        """Load the draft model on the target's backend, or on one of its own where `dtype`, `activations` or
        `threads` is given. Either way the draft runs with the activations and threads it was loaded with and
        the target keeps its own: loading sets the process's (a backend's load does), so they are put back
        after it, and the draft model passes its own to every kernel call (`Decoder.pin_kernels`)."""
        super().setup(target)
        gguf = GGUFFile(resolve_model(self.model_name))
        self.tokenizer = Tokenizer.from_gguf(gguf)
        check_vocab_compatible(target.tokenizer, self.tokenizer, self.model_name)
        own = {name: value for name, value in
               (("dtype", self.dtype), ("activations", self.activations), ("threads", self.threads)) if value}
        targets_int8, targets_threads = native.int8_flag(), torch.get_num_threads()
        try:
            backend = type(target.backend)(**own) if own else target.backend
        except TypeError as e:  # a backend without that option (cuda has no activations or threads)
            raise ConfigError(f"drafter 'draft-model': the {type(target.backend).__name__} takes no "
                              f"{'/'.join(own)} option ({e}); drop -o drafter.{next(iter(own))}") from None
        try:
            self.model = backend.load_model(gguf)
            int8, threads = native.int8_flag(), torch.get_num_threads()
        finally:
            native.set_int8_flag(targets_int8)
            torch.set_num_threads(targets_threads)
        if (int8, threads) != (targets_int8, targets_threads) and hasattr(self.model, "pin_kernels"):
            self.model.pin_kernels(int8, threads if threads < targets_threads else 0)
        self.vocab_size = min(target.tokenizer.vocab_size, self.model.config.vocab_size)
        self.cache_len = min(self.context, self.model.config.context_length)
        self.free_caches: list[Any] = []  # caches of finished sequences, for the next ones
        self.step_clock = DraftStepClock()
        self.device = self.model.device
        self.head_ids = None  # token id of each row of a reduced head; None: the whole head
        if 0 < self.head_rows < self.vocab_size:
            self.head_ids = self._reduce_head(gguf)
        self.kind = DraftKind("draft-model", cost=self.step_cost or self._untimed_step_cost(gguf, target.gguf))

    def _untimed_step_cost(self, gguf: GGUFFile, target_gguf) -> float | None:
        """What a draft step costs in target steps before any timing: the share of the bytes each reads (decode on
        a CPU is bound by them), less the rows a reduced head skips; None where the target has no file. On an
        accelerator small steps are bound by kernel launches, a fixed number per layer, so the share of layers
        (above what was measured there, so it drafts less until timed: docs/bench/gpu.md) is the guess."""
        head = gguf.tensors.get("output.weight") or gguf.tensors.get("token_embd.weight")
        if not isinstance(target_gguf, GGUFFile) or head is None:
            return None
        if torch.device(self.device).type != "cpu":
            return min(trunk_layers(gguf) / max(trunk_layers(target_gguf), 1), 1.0)
        skipped = 0 if self.head_ids is None else head.nbytes * (1 - len(self.head_ids) / head.shape[0])
        return min((stored_weight_bytes(gguf) - skipped) / max(stored_weight_bytes(target_gguf), 1), 1.0)

    def _reduce_head(self, gguf: GGUFFile) -> torch.Tensor:
        """Swap the draft model's head for its first `head_rows` rows and every control and user-defined
        token (the end-of-turn ones among them); the token embedding keeps its own rows."""
        special = [i for i in range(self.head_rows, self.vocab_size)
                   if self.tokenizer.token_type(i) in (TokenType.CONTROL, TokenType.USER_DEFINED)]
        ids = torch.cat([torch.arange(self.head_rows), torch.tensor(special, dtype=torch.long)])
        name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        m = self.model
        m.output = load_linear(gguf, [name], m.linear_form, m.dtype, m.device, {name: lambda rows: rows[ids]})
        return ids

    def begin(self, prompt: list[int], params: SamplingParams, controls: DraftControls) -> DraftModelState:
        """A sequence whose prompt the draft model reads at its first draft, not now: under load most sequences of
        a batch may never draft (`BatchPricing` finds that drafting does not pay), and a prompt read for each
        would cost them all. That read is the first draft's upkeep, not billed per drafted token, so `--draft-max
        auto` still prices drafting by what a round costs."""
        if controls.draft_p_min == 0.0 and self.p_min > 0.0:
            controls = dataclasses.replace(controls, draft_p_min=self.p_min)
        state = super().begin(prompt, params, controls)
        state.cache = self.free_caches.pop() if self.free_caches else self.model.new_cache(self.cache_len)
        state.cache.truncate(0)
        state.unread = min(len(prompt), state.cache.max_len - 1)
        return state

    def _read_prompt(self, state: DraftModelState, tokens: list[int]) -> float:
        """Read the sequence's prompt (`tokens` starts with it) as a prefill reads one; the seconds it took."""
        t = time.perf_counter()
        self.model.forward(torch.tensor(tokens[: state.unread], device=self.device), 0, state.cache, last_only=True)
        state.unread = 0
        return time.perf_counter() - t

    def end(self, state: DraftModelState) -> None:
        if state.cache is not None:
            self.free_caches.append(state.cache)
            state.cache = None

    def draft_kind(self, state: DraftModelState, tokens: list[int]) -> DraftKind:
        return self.kind

    def catch_up_rows(self, state: DraftModelState, tokens: list[int]) -> int:
        """Rows the next draft reads before its draft step: the prompt, if not read yet, and the tokens accepted
        since the last draft (the last token is the draft step's own row)."""
        have = 0 if state.unread else state.cache.length
        return max(len(tokens) - 1 - have, 0)

    def rollback(self, state: DraftModelState, length: int) -> None:
        state.cache.truncate(min(state.cache.length, length))

    def propose(self, state: DraftModelState, tokens: list[int], k: int) -> Draft:
        return self.propose_many([state], [tokens], [k])[0]

    def propose_many(self, states: list[DraftModelState], tokens: list[list[int]], ks: list[int]) -> list[Draft]:
        """Every sequence's draft in lockstep, one draft-model forward a position for all of them (its weights are
        read once a step, not once per sequence): first each one's catch-up (the rows accepted since its last
        draft, and the last token again: the first draft needs the logits after it), then one row of each
        sequence still drafting. Each sequence's draft is what it gets alone: the rows are bit for bit its own."""
        drafts = [Draft() for _ in states]
        live = []  # (index, tokens drafted so far, q rows, k): the sequences drafting
        read_s = [0.0] * len(states)
        for i, (state, toks, k) in enumerate(zip(states, tokens, ks)):
            k = min(k, state.cache.max_len - len(toks))
            if k > 0 and toks:  # nothing to condition on: nothing to draft (the contract suite found it raising)
                if state.unread:
                    read_s[i] = self._read_prompt(state, toks)
                state.cache.truncate(min(state.cache.length, len(toks) - 1))
                live.append((i, [], [], k))
        if not live:
            return drafts
        pending = [tokens[i][states[i].cache.length:] for i, *_ in live]
        t = time.perf_counter()
        logits = self._last_logits([states[i] for i, *_ in live], pending)
        took = time.perf_counter() - t
        # a catch-up after rounds that drafted nothing: one step of it is the first draft's (DraftStepClock), or
        # one round after a stretch without drafts would price drafting out; the rest is shared by the rows caught
        # up beyond each sequence's last token (none: the forward was all draft steps)
        upkeep = self.step_clock.charge(took, sum(map(len, pending)))
        extra = [len(p) - 1 for p in pending]
        for (i, *_), rows in zip(live, extra):
            drafts[i].upkeep_s = read_s[i] + (upkeep * rows / sum(extra) if sum(extra) else 0.0)
        while live:
            going = []
            for (i, drafted, qs, k), row in zip(live, logits):
                state = states[i]
                token, q = draft_position(row, state.params, state.controls, self.sample, state.draws,
                                          len(tokens[i]) + len(drafted))
                if token is not None:
                    drafted.append(token)
                    if q is not None:
                        qs.append(q)
                if token is None or len(drafted) == k:
                    drafts[i] = Draft(drafted, torch.stack(qs) if qs else None, upkeep_s=drafts[i].upkeep_s)
                else:
                    going.append((i, drafted, qs, k))
            live = going
            if live:
                t = time.perf_counter()
                logits = self._last_logits([states[i] for i, *_ in live], [d[-1:] for _, d, _, _ in live])
                if len(live) == 1:
                    self.step_clock.teach(time.perf_counter() - t)
        return drafts

    def _last_logits(self, states: list[DraftModelState], rows: list[list[int]]) -> list[torch.Tensor]:
        """One forward of each sequence's `rows` at the end of its cache: the logits after each one's last row,
        as float32 rows over the target's vocabulary (-inf off a reduced head: those tokens are never drafted)."""
        caches = [s.cache for s in states]
        ids = torch.tensor([t for r in rows for t in r], device=self.device)
        if len(states) == 1:
            logits = self.model.forward(ids, caches[0].length, caches[0], last_only=True)
        else:
            logits = self.model.forward_sequences(ids, [len(r) for r in rows], [c.length for c in caches], caches,
                                                  last_rows=True)
        logits = logits.float().cpu()
        if self.head_ids is None:
            return list(logits[:, : self.vocab_size])
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head_ids] = logits
        return list(full)


@hookimpl
def register_drafters(register):
    register("draft-model", DraftModelDrafter, aliases=("draft",), options={
        "model": (str, "the draft GGUF: a catalog name or a path (also --draft-model)"),
        "sample": (bool, "sample drafts from q instead of argmax (the acceptor then uses the full-q rule)"),
        "context": (int, "the draft model's KV cache length"),
        "dtype": (str, "the draft model's dtype on the target's backend (empty: the target's)"),
        "activations": (str, "the draft model's activations on the CPU backend: auto, int8 or float32 (empty: "
                        "the target's); the target keeps its own"),
        "threads": (int, "threads for the draft model's kernels, at most the target's (0: the target's); the target keeps its own"),
        "p_min": (float, "stop a draft where the draft model's largest probability is below this, as "
                   "--draft-p-min does (which wins where given); 0 = draft the length asked"),
        "step_cost": (float, "a draft step's cost in target steps, for --draft-max auto before it has timed one "
                      "(and in seeded runs with q, which use no timings); 0 = the share of bytes each reads"),
        "head_rows": (int, "draft from the first N rows of the draft model's output head (and every control "
                      "token) only: faster drafts of a large vocabulary's frequent tokens; 0 = the whole head"),
    })
