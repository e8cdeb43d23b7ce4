"""Deprecated: `outrider.drafting` moved to `outrider.spec.drafter`; plugins import from `outrider.api`.

Kept for this release only, so plugins written against 0.1 keep working (docs/plugins.md, Compatibility).
It goes in the next release."""

import warnings

from outrider.spec.drafter import *  # noqa: F403

warnings.warn("outrider.drafting is deprecated: import from outrider.api", DeprecationWarning, stacklevel=2)
