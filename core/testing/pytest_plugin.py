"""The pytest plugin installing outrider registers (entry point `pytest11`): fixtures for plugin tests.

Nothing heavy is imported at module level: pytest loads this module in every project of an environment
where outrider is installed, so torch and the models are imported only when a fixture is first used.
"""

from __future__ import annotations

import pytest


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
    """An `outrider.drafting.Target` for the tiny llama on the CPU backend: what `Drafter.setup` receives."""
    return outrider_contract_fixtures.target("llama")


@pytest.fixture
def toy_model():
    """Seeded toy target/drafter logit tables (`outrider.testing.toy.ToyModel`) with analytic distributions."""
    from outrider.testing.toy import ToyModel

    return ToyModel(seed=3)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
