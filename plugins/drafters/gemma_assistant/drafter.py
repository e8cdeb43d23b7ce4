"""The `gemma-assistant` drafter: Gemma 4's assistant-MTP model drafting from the target's own state.

`--drafter gemma-assistant --draft-model mtp-gemma-4-XX.gguf` (llama.cpp: `--spec-type draft-mtp -md FILE`).
The assistant has no KV cache and reads no prompt: after each verify the runner shows it (`observe`) the
target's final-normed hidden states and KV cache. A round starts from the row (t0, the target hidden that
predicted t0, position of t0) and chains k steps at that same position, each feeding the target's embedding of
the token just drafted and the assistant's own projected hidden state, as llama.cpp's draft-mtp and
transformers' SinglePositionMultiTokenCandidateGenerator do. Its layers attend over the target's cached K/V
of the last sliding and the last global layer (through the target's KV-sharing map), positions before t0.

At temperature > 0 it samples each draft from its own softmax warped like the target's and reports it as q, so
the sampled acceptor's full-q rule keeps the output lossless; at temperature 0 (or with `sample = false`) it
takes the argmax, as llama.cpp does. `--draft-p-min` stops a round at a draft below that probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.catalog import resolve_model
from outrider.errors import ConfigError, ModelFileError
from outrider.hookspecs import hookimpl
from outrider.io.gguf import GGUFFile
from outrider.plugins.drafters.gemma_assistant.model import DEFAULT_CENTROID_TOP_K, HEADS, Gemma4Assistant
from outrider.spec.drafter import (
    NEEDS_TARGET_HIDDEN,
    NEEDS_TARGET_KV,
    Draft,
    DrafterBase,
    DraftState,
    Target,
)

TARGET_ARCHITECTURE = "gemma4"


def target_kv_layers(model) -> dict[str, int]:
    """The cache layers the assistant reads: those of the target's last sliding and last global layer,
    resolved through its KV-sharing map (transformers' shared_kv_states: the last layer of each type)."""
    cfg = model.config
    source = getattr(model, "kv_source_layer", tuple(range(cfg.n_layers)))
    last = {}
    for i, local in enumerate(cfg.is_local):
        last["swa" if local else "full"] = source[i]
    return last


@dataclass
class AssistantState(DraftState):
    hidden: torch.Tensor | None = None  # the last certain row's target hidden state: the one that predicted t0
    end: int = 0  # the position after that row
    cache: Any = None  # the target's KV cache of this sequence, as observe last showed it


class GemmaAssistantDrafter(DrafterBase):
    State = AssistantState
    needs = frozenset({NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV})
    gives_draft_probs = True  # when it samples (temperature > 0 and sample = true); assembly reads the instance

    def __init__(self, model: str = "", head: str = "auto", centroid_top_k: int = DEFAULT_CENTROID_TOP_K,
                 sample: bool = True):
        if not model:
            raise ConfigError("drafter 'gemma-assistant' needs the assistant GGUF: pass --draft-model "
                              "FILE.gguf (e.g. mtp-gemma-4-31B-it.gguf)")
        if head not in HEADS:
            raise ConfigError(f"drafter 'gemma-assistant': unknown head '{head}'; choose one of: {', '.join(HEADS)}")
        self.model_name, self.head, self.centroid_top_k, self.sample = model, head, centroid_top_k, sample
        self.gives_draft_probs = sample

    def setup(self, target: Target) -> None:
        super().setup(target)
        tpath, apath = target.gguf.path, self.model_name
        pair = f"target {tpath} and assistant {apath}"
        if target.gguf.architecture != TARGET_ARCHITECTURE:
            raise ConfigError(f"{pair}: the target is '{target.gguf.architecture}', but a Gemma 4 assistant drafts "
                              "only for a gemma4 target; pass the Gemma 4 model it was trained with as -m")
        gguf = GGUFFile(resolve_model(apath))
        try:
            self.assistant = Gemma4Assistant(gguf, dtype=target.model.dtype, device=target.model.device,
                                             head=self.head, centroid_top_k=self.centroid_top_k)
        except ModelFileError as exc:
            raise ConfigError(f"{pair}: {exc}") from None
        a, t = self.assistant.config, target.model.config
        if a.backbone_hidden_size != t.hidden_size:
            raise ConfigError(f"{pair}: the assistant was trained for a {a.backbone_hidden_size}-wide target, this "
                              f"target is {t.hidden_size} wide; pair each assistant with its own Gemma 4 size")
        if a.vocab_size < t.vocab_size:
            raise ConfigError(f"{pair}: the assistant has {a.vocab_size} tokens, fewer than the target's "
                              f"{t.vocab_size}; pair each assistant with its own Gemma 4 model")
        self.kv_layers = target_kv_layers(target.model)
        for i, swa in enumerate(a.is_swa):
            kind = "swa" if swa else "full"
            src = self.kv_layers.get(kind)
            want = (a.n_kv_heads[i], a.head_dim_swa if swa else a.head_dim)
            have = None if src is None else (t.n_kv_heads[src], t.head_dim[src])
            if have != want:
                raise ConfigError(f"{pair}: assistant layer {i} ({kind}) reads {want[0]} kv heads of width {want[1]}, "
                                  f"the target's last {kind} layer has "
                                  f"{'none' if have is None else f'{have[0]} of width {have[1]}'}; "
                                  "pair each assistant with its own Gemma 4 model")
        self.vocab_size = t.vocab_size
        self.device = target.model.device

    def observe(self, state: AssistantState, hidden: torch.Tensor, start: int, cache) -> None:
        # only the last certain row matters: it is the target hidden that predicted the next t0
        state.hidden, state.end, state.cache = hidden[-1:].clone(), start + hidden.shape[0], cache

    def rollback(self, state: AssistantState, length: int) -> None:
        if length < state.end:  # the observed row is no longer the one before t0
            state.hidden = None

    def propose(self, state: AssistantState, tokens: list[int], k: int) -> Draft:
        pos = len(tokens) - 1  # t0's position: the target has cached exactly the positions before it
        if k <= 0 or state.hidden is None or state.end != pos or state.cache is None or state.cache.length < pos:
            return Draft()
        kv = {kind: state.cache.read(layer, pos) for kind, layer in self.kv_layers.items()}
        embed = self.target.model.embed
        h = state.hidden

        def next_logits(drafted: list[int]) -> torch.Tensor:
            nonlocal h
            token = drafted[-1] if drafted else tokens[-1]
            inputs = self.assistant.input_rows(embed(torch.tensor([token], device=self.device)), h)
            logits, h = self.assistant.forward(inputs, pos, kv)
            return logits[0][: self.vocab_size].float().cpu()

        return self.draft_from_logits(state, k, next_logits, tokens, self.sample)


@hookimpl
def register_drafters(register):
    register("gemma-assistant", GemmaAssistantDrafter, aliases=("gemma4-assistant",),
             capabilities={"target_architecture": TARGET_ARCHITECTURE}, options={
        "model": (str, "the assistant GGUF (gemma4-assistant), e.g. mtp-gemma-4-31B-it.gguf (also --draft-model)"),
        "head": (str, "output head: auto (the file's centroid head if it has one), dense (llama.cpp's "
                              "choice: the tied head over the whole vocabulary), centroids"),
        "centroid_top_k": (int, "centroids kept by the centroid head (transformers' "
                                                        "centroid_intermediate_top_k; GGUF files do not record it)"),
        "sample": (bool, "at temperature > 0, sample drafts from the assistant's warped softmax and report it "
                               "as q; false: argmax drafts as llama.cpp (the acceptor then uses the one-hot rule)"),
    })
