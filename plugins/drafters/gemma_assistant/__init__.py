"""The `gemma-assistant` drafter as one package: the drafter (drafter.py) and the Gemma 4 assistant model
it runs (model.py)."""

from __future__ import annotations

from outrider.plugins.drafters.gemma_assistant.drafter import GemmaAssistantDrafter, register_drafters

__all__ = ["GemmaAssistantDrafter", "register_drafters"]
