"""The plugin API: everything a third-party backend, drafter or acceptor imports, from one place.

    from outrider.api import Draft, DrafterBase, DraftControls, SamplingParams, hookimpl

These names are Outrider's compatibility promise to plugins (docs/plugins.md); the modules behind them
are free to move. The contract classes (`BackendContract`, `DrafterContract`, `AcceptorContract`) need
pytest and are imported on first use, so a plugin's runtime import of this module does not pull pytest in.
"""

from __future__ import annotations

from typing import Any

from outrider.errors import ConfigError, ModelFileError, OutriderError
from outrider.hookspecs import hookimpl
from outrider.models.backend import Backend
from outrider.spec.acceptance import Acceptor, AcceptResult, VerifyRound, greedy_round, sampled_round
from outrider.spec.drafter import (
    DEFAULT_KIND,
    NEEDS_DRAFT_MODEL,
    NEEDS_MTP_HEAD,
    NEEDS_TARGET_HIDDEN,
    NEEDS_TARGET_KV,
    Draft,
    DraftControls,
    Drafter,
    DrafterBase,
    DraftKind,
    Target,
    draft_loop,
)
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import SamplingParams, argmax_token, sample_at, warp

_CONTRACTS = ("BackendContract", "DrafterContract", "AcceptorContract")

__all__ = [
    # registering
    "hookimpl",
    # errors a plugin raises: one line that names the fix
    "OutriderError", "ConfigError", "ModelFileError",
    # backends
    "Backend",
    # drafters
    "Drafter", "DrafterBase", "Draft", "DraftKind", "DEFAULT_KIND", "DraftControls", "Target", "draft_loop",
    "NEEDS_DRAFT_MODEL", "NEEDS_TARGET_HIDDEN", "NEEDS_TARGET_KV", "NEEDS_MTP_HEAD",
    # acceptors and the acceptance rules
    "Acceptor", "VerifyRound", "AcceptResult", "greedy_round", "sampled_round",
    # sampling
    "SamplingParams", "warp", "sample_at", "argmax_token", "PositionRandom",
    # the contract suite (needs pytest)
    *_CONTRACTS,
]


def __getattr__(name: str) -> Any:
    if name in _CONTRACTS:
        from outrider.testing import contracts

        return getattr(contracts, name)
    raise AttributeError(f"module 'outrider.api' has no attribute {name!r}")
