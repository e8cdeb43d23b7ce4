"""Deprecated: `outrider.verify` moved to `outrider.spec.acceptance`; plugins import from `outrider.api`.

Kept for this release only, so plugins written against 0.1 keep working (docs/plugins.md, Compatibility).
It goes in the next release."""

import warnings

from outrider.spec.acceptance import Acceptor, AcceptResult, VerifyRound, as_acceptor, greedy_round, sampled_round  # noqa: F401

warnings.warn("outrider.verify is deprecated: import from outrider.api", DeprecationWarning, stacklevel=2)
