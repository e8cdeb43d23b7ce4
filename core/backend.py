"""Deprecated: `outrider.backend` moved to `outrider.models.backend`; plugins import from `outrider.api`.

Kept for this release only, so plugins written against 0.1 keep working (docs/plugins.md, Compatibility).
It goes in the next release."""

import warnings

from outrider.models.backend import DTYPE_ALIASES, DTYPES, Backend  # noqa: F401

warnings.warn("outrider.backend is deprecated: import from outrider.api", DeprecationWarning, stacklevel=2)
