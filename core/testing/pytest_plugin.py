"""The pytest plugin installing outrider registers (entry point `pytest11`): fixtures for plugin tests.

Nothing heavy is imported at module level: pytest loads this module in every project of an environment
where outrider is installed, so torch and the models are imported only when a fixture is first used.
"""

from __future__ import annotations

import pytest

# Tests that ask for one of these run on one torch thread (see outrider.testing.threads).
_TINY_MODEL_FIXTURES = frozenset({"outrider_contract_fixtures", "tiny_llama_path", "tiny_gemma3_path", "tiny_target",
                                  "toy_model"})
_THREADS_INI = "outrider_torch_threads"


def pytest_addoption(parser):
    parser.addini(_THREADS_INI, "torch threads for every test of this project (default: one thread only for "
                                "tests that use outrider's tiny-model fixtures)", default="")


@pytest.fixture(autouse=True)
def _outrider_torch_threads(request):
    """Tiny-model tests on one torch thread, restored after each test.

    Applies to the tests that use outrider's fixtures (the contract tests), or to every test when the project
    sets the ini option `outrider_torch_threads` (Outrider's own suite sets 1). A test that needs threads
    says so: `@pytest.mark.torch_threads(2)`, or `torch_threads(0)` to keep torch's setting.
    """
    marker = request.node.get_closest_marker("torch_threads")
    if marker is not None:
        n = int(marker.args[0])
    elif request.config.getini(_THREADS_INI):
        n = int(request.config.getini(_THREADS_INI))
    elif _TINY_MODEL_FIXTURES & set(request.fixturenames):
        n = 1
    else:
        yield
        return
    from outrider.testing.threads import torch_threads

    with torch_threads(n):
        yield


@pytest.fixture(scope="session")
def outrider_contract_fixtures(tmp_path_factory):
    """Tiny llama/gemma3 GGUF models, written once per session, and plain-decoding oracles on them."""
    from outrider.testing.fixtures import ContractFixtures

    return ContractFixtures(tmp_path_factory.mktemp("outrider-contract"))


@pytest.fixture(scope="session")
def tiny_llama_path(outrider_contract_fixtures):
    """A tiny random-weight llama GGUF (byte-level vocabulary of 265 tokens, 2 layers, context 256)."""
    return outrider_contract_fixtures.tiny_llama_path


@pytest.fixture(scope="session")
def tiny_gemma3_path(outrider_contract_fixtures):
    """A tiny random-weight gemma3 GGUF (SPM-style vocabulary, sliding-window layers, context 256)."""
    return outrider_contract_fixtures.tiny_gemma3_path


@pytest.fixture(scope="session")
def tiny_target(outrider_contract_fixtures):
    """An `outrider.api.Target` for the tiny llama on the CPU backend: what `Drafter.setup` receives."""
    return outrider_contract_fixtures.target("llama")


@pytest.fixture
def toy_model():
    """Seeded toy target/drafter logit tables (`outrider.testing.toy.ToyModel`) with analytic distributions."""
    from outrider.testing.toy import ToyModel

    return ToyModel(seed=3)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "torch_threads(n): run the test on n torch threads (0: torch's setting); "
                                       "tests that use outrider's fixtures otherwise run on one")
