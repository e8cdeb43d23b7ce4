"""The plugin API: everything a third-party backend, drafter or acceptor imports, from one place.

    from outrider.api import Draft, DrafterBase, DraftControls, SamplingParams, hookimpl

These names are Outrider's compatibility promise to plugins (docs/plugins.md); the modules behind them
are free to move. The contract classes (`BackendContract`, `DrafterContract`, `AcceptorContract`) and the
test helpers need pytest or are for tests only: they are imported on first use, so a plugin's runtime
import of this module does not pull pytest in.
"""

from __future__ import annotations

from typing import Any

from outrider.errors import ConfigError, ModelFileError, OutriderError
from outrider.hookspecs import hookimpl
from outrider.models import load_model
from outrider.models.backend import Backend
from outrider.registry import build_registry
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
    DraftState,
    DraftStepClock,
    Target,
    draft_loop,
)
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.random_streams import PositionRandom
from outrider.spec.sampling import (GREEDY_BELOW, SamplingParams, argmax_token, sample_at, sample_logits,
                                    sample_rows, warp)

# the contract suite and its test helpers (they need pytest, or are only for tests): imported on first use
_TESTING = {"BackendContract": "contracts", "DrafterContract": "contracts", "AcceptorContract": "contracts",
            "registry_params": "contracts", "ContractFixtures": "fixtures", "ToyModel": "toy",
            "CopyingToyModel": "toy", "chi2_test": "stats"}

__all__ = [
    # registering, and building plugins as the CLI does
    "hookimpl", "build_registry",
    # errors a plugin raises: one line that names the fix
    "OutriderError", "ConfigError", "ModelFileError",
    # backends
    "Backend", "load_model",
    # drafters
    "Drafter", "DrafterBase", "DraftState", "Draft", "DraftKind", "DEFAULT_KIND", "DraftControls", "Target", "draft_loop",
    "DraftStepClock", "DrafterTraits",
    "NEEDS_DRAFT_MODEL", "NEEDS_TARGET_HIDDEN", "NEEDS_TARGET_KV", "NEEDS_MTP_HEAD",
    # acceptors and the acceptance rules
    "Acceptor", "VerifyRound", "AcceptResult", "greedy_round", "sampled_round",
    # sampling
    "SamplingParams", "GREEDY_BELOW", "warp", "sample_at", "sample_logits", "sample_rows", "argmax_token", "PositionRandom",
]  # the contract suite and its helpers (_TESTING) are attributes only: `import *` must not pull in pytest


def __getattr__(name: str) -> Any:
    if name in _TESTING:
        from importlib import import_module

        return getattr(import_module(f"outrider.testing.{_TESTING[name]}"), name)
    raise AttributeError(f"module 'outrider.api' has no attribute {name!r}")
