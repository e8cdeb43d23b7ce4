"""The plugin contract (outrider.testing) against every registered plugin: the built-ins and every
third-party package installed in this environment (e.g. examples/outrider-suffix once installed).

Each (plugin, check) pair is one test; checks a capability makes meaningless are skipped with the reason,
GPU checks are marked `gpu` and skip without CUDA.
"""

from __future__ import annotations

import pytest

from outrider.testing.contracts import registry_params

# Extra option sets for plugins whose options switch behaviour the default does not exercise.
VARIANTS = {("drafter", "draft-model"): [{"sample": True, "p_min": 0.4}, {"sample": True, "p_min": 0.0}], ("drafter", "gemma-assistant"): [{"sample": False}],
            ("drafter", "mtp"): [{"sample": False}]}


@pytest.mark.parametrize("case", registry_params(variants=VARIANTS))
def test_contract(case, outrider_contract_fixtures):
    case.run(outrider_contract_fixtures)
