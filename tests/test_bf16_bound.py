"""The contract's bfloat16 tolerance (`outrider.testing.tolerance`) is derived, not chosen: the recorded oracle
errors are what transformers' own model of each fixture is off by in bfloat16 against float64 (re-measured
here), the built-in CPU backend's bfloat16 path stays within the bound on every fixture (the path the GPU runs),
and a model with one wrong weight vector falls outside it.

Oracles: transformers in float64 (`oracles.bf16_error`, the fixture's GGUF weights dequantized by gguf); the
CPU backend's dense float32 path, the contract's reference, checked against the float64 oracle first."""

from __future__ import annotations

import pytest
import torch
from oracles.bf16_error import bf16_error, logits, oracle_inputs, transformers_model

from outrider.io.gguf import GGUFFile
from outrider.models.static_step import STATIC_ARCHITECTURES
from outrider.plugins.backends.cpu import CPUBackend
from outrider.testing.contracts import BackendContract
from outrider.testing.fixtures import ARCHITECTURES
from outrider.testing.tolerance import BF16_FACTOR, BF16_ORACLE_ERROR, bf16_bound

ARCHS = tuple(dict.fromkeys(ARCHITECTURES + STATIC_ARCHITECTURES))
RECORDED_WITHIN = 0.25  # relative: the table is re-measured on this machine's torch, whose bf16 kernels may round elsewhere
REFERENCE_ATOL = 1e-4  # float32 against float64 on logits of magnitude ~10-30
WRONG_NORM = 1.25  # the output norm's weights scaled: a wrong norm offset or scale, the classic porting bug


class TestCpuBf16Contract(BackendContract):
    """The whole backend contract, `matches_the_cpu_reference` included, on the bfloat16 path the GPU runs."""

    plugin_name = "cpu"
    plugin_options = {"dtype": "bfloat16", "weights": "dense"}


def _models(fixtures, arch, **options):
    return CPUBackend(**options).load_model(GGUFFile(fixtures.model_path(arch)))


def _logits(model, ids):
    return model.forward(ids, 0, model.new_cache(64)).double()


def test_the_table_covers_every_fixture_the_checks_run():
    assert set(ARCHS) <= set(BF16_ORACLE_ERROR)
    with pytest.raises(KeyError, match="no recorded bfloat16 oracle error"):
        bf16_bound("mamba", torch.ones(1))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_recorded_oracle_error_is_transformers_bf16_error(outrider_contract_fixtures, arch):
    pytest.importorskip("transformers")
    path = outrider_contract_fixtures.model_path(arch)
    # the oracle is the model the reference computes: float32 dense within REFERENCE_ATOL of it in float64
    truth, reference = transformers_model(path), _models(outrider_contract_fixtures, arch, weights="dense")
    for ids in oracle_inputs(reference.config.vocab_size):
        diff = float((_logits(reference, ids) - logits(truth, ids)).abs().max())
        assert diff <= REFERENCE_ATOL, f"{arch}: transformers' model and the float32 reference differ by {diff:.3g}"
    measured, recorded = bf16_error(path), BF16_ORACLE_ERROR[arch]
    assert abs(measured - recorded) <= RECORDED_WITHIN * measured, \
        f"{arch}: transformers' bfloat16 error is {measured:.4g}, the table records {recorded:.4g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cpu_bf16_path_is_within_the_bound_and_a_wrong_weight_is_not(outrider_contract_fixtures, arch):
    reference = _models(outrider_contract_fixtures, arch, weights="dense")
    bf16 = _models(outrider_contract_fixtures, arch, dtype="bfloat16", weights="dense")
    wrong = _models(outrider_contract_fixtures, arch, dtype="bfloat16", weights="dense")
    wrong.output_norm.mul_(WRONG_NORM)
    worst_ratio, caught = 0.0, 0.0
    for ids in oracle_inputs(reference.config.vocab_size):
        want = _logits(reference, ids)
        bound = bf16_bound(arch, want)
        diff = float((_logits(bf16, ids) - want).abs().max())
        assert diff <= bound, f"{arch}: bfloat16 CPU logits {diff:.3g} from the float32 reference, bound {bound:.3g}"
        worst_ratio = max(worst_ratio, diff / BF16_ORACLE_ERROR[arch])
        caught = max(caught, float((_logits(wrong, ids) - want).abs().max()) / bound)
    # the factor is justified by another honest implementation landing near the oracle, not at the bound's edge
    assert worst_ratio <= BF16_FACTOR / 1.5, f"{arch}: the CPU bf16 error is {worst_ratio:.2f}x the oracle's"
    assert caught > 1, f"{arch}: output norm x{WRONG_NORM} is only {caught:.2f}x the bound: the bound is vacuous"
