"""docs/plugins.md names every registered contract check, in its table of checks, under the right kind."""

from __future__ import annotations

import re
from pathlib import Path

from outrider.hookspecs import PLUGIN_KINDS
from outrider.testing.checks import CHECKS

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def test_the_guides_table_of_checks_lists_exactly_the_registered_checks():
    rows = re.findall(r"^\| (\w+) \| `(\w+)` \|", GUIDE.read_text(), flags=re.MULTILINE)
    for kind in PLUGIN_KINDS:
        documented = [name for k, name in rows if k == kind]
        registered = [check.name for check in CHECKS[kind]]
        assert sorted(documented) == sorted(registered), \
            f"docs/plugins.md's table of {kind} checks: missing {sorted(set(registered) - set(documented))}, " \
            f"not registered {sorted(set(documented) - set(registered))}"
    assert {k for k, _ in rows} <= set(PLUGIN_KINDS)
