"""Deprecated: `outrider.sampling` moved to `outrider.spec.sampling`; plugins import from `outrider.api`.

Kept for this release only, so plugins written against 0.1 keep working (docs/plugins.md, Compatibility).
It goes in the next release."""

import warnings

from outrider.spec.acceptance import AcceptResult  # noqa: F401
from outrider.spec.random_streams import PositionRandom  # noqa: F401
from outrider.spec.sampling import *  # noqa: F403
from outrider.spec.sampling import GREEDY_BELOW  # noqa: F401

warnings.warn("outrider.sampling is deprecated: import from outrider.api", DeprecationWarning, stacklevel=2)
