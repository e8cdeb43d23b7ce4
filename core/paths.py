"""Where Outrider keeps what it makes once per machine: `$OUTRIDER_HOME`, default `~/.cache/outrider`, with
`models/` (the catalog's files), `tokenizers/`, `native/` (the compiled kernels), `packed/` (weights packed for
them: `outrider.models.packed_cache`) and `reference/` (test oracles). Its own module so the kernel build and
the tokenizer need not import the model catalog."""

from __future__ import annotations

import os
from pathlib import Path


def outrider_home() -> Path:
    return Path(os.environ.get("OUTRIDER_HOME") or Path.home() / ".cache" / "outrider")
