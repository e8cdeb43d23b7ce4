"""The argmax-stable contract's checker (`outrider.testing.argmax_stable`), on hand-made cases and on the CPU
backend, whose verify passes are exact: there the drift is 0 and speculative greedy equals plain greedy."""

from __future__ import annotations

import pytest
import torch

from outrider.io.gguf import GGUFFile
from outrider.plugins.backends.cpu import CPUBackend
from outrider.testing.argmax_stable import (
    assert_argmax_stable,
    greedy_with_gaps,
    judge,
    near_tie_rate,
    top2_gaps,
    verify_drift,
)
from outrider.testing.fixtures import plain_greedy


def test_top2_gaps_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0], [5.0, -2.0, 1.0]])
    assert top2_gaps(logits).tolist() == [0.5, 0.0, 4.0]
    assert near_tie_rate(top2_gaps(logits), 0.5) == pytest.approx(2 / 3)
    assert near_tie_rate(top2_gaps(logits), 0.49) == pytest.approx(1 / 3)


def test_equal_outputs_hold_whatever_the_gaps():
    assert judge([1, 2, 3], [1, 2, 3], torch.tensor([9.0, 9.0, 9.0]), 0.1).holds


def test_a_difference_at_a_near_tie_holds():
    v = judge([1, 2, 3, 4], [1, 2, 7, 8], torch.tensor([5.0, 5.0, 0.05, 5.0]), 0.1)
    assert v.holds and v.first_difference == 2 and v.gap == pytest.approx(0.05)


def test_a_difference_at_a_clear_argmax_fails():
    gaps = torch.tensor([5.0, 0.05, 3.0])
    assert not judge([1, 2, 3], [1, 2, 9], gaps, 0.1).holds
    with pytest.raises(AssertionError, match="token 2"):
        assert_argmax_stable([1, 2, 3], [1, 2, 9], gaps, 0.1, "case")


def test_a_shorter_output_is_compared_over_its_length():
    assert judge([1, 2, 3], [1, 2], torch.tensor([1.0, 1.0, 1.0]), 0.0).first_difference is None


@pytest.fixture(scope="module")
def cpu_llama(outrider_contract_fixtures):
    # torch ops with float64 attention: exact verify passes, and no native build to wait for
    return CPUBackend(weights="dense").load_model(GGUFFile(outrider_contract_fixtures.model_path("llama")))


def test_greedy_with_gaps_is_plain_greedy(cpu_llama):
    prompt = [5, 6, 7, 8, 9, 5, 6]
    tokens, gaps = greedy_with_gaps(cpu_llama, prompt, 10)
    assert tokens == plain_greedy(cpu_llama, prompt, 10)  # a fresh full forward per token
    assert gaps.shape == (10,) and bool((gaps >= 0).all())


def test_the_exact_cpu_backend_has_no_verify_drift(outrider_contract_fixtures, cpu_llama):
    """The compact CPU kernels are batch invariant by construction: drift exactly 0. Torch's float32 matmul
    is not (another kernel for 7 rows than for 1), which the checker sees."""
    prefix, block = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([10, 11, 12, 13, 14, 15, 16])
    assert verify_drift(outrider_contract_fixtures.target("llama").model, prefix, block) == 0.0
    assert 0.0 < verify_drift(cpu_llama, prefix, block) < 1e-3
