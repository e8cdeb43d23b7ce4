"""The CUDA backend on a GPU (every test here is marked `gpu` and skips without CUDA).

Oracles: the float32 CPU backend, dense (parity, within the bfloat16 bound `outrider.testing.tolerance` derives
from transformers' own bfloat16 error on each fixture); the same CUDA model's own one-token forwards (verify
passes, truncate-then-replay, within the same bound); plain greedy decoding on the same CUDA model, under the
argmax-stable contract (`outrider.testing.argmax_stable`) with a margin of the bound where the model computes in
bfloat16 (the drift this run measures is printed beside it);
the target's own distribution (chi-square) for the sampled acceptor fed with GPU logits. Each runs for the
default path (compact weights, CUDA graphs), compact weights without graphs, and the old dense eager path,
on the architectures with compact GPU weights and graphed steps (llama, gemma3; gemma4 runs dense and eager
on the GPU, checked by the contract classes below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.io.gguf import GGUFFile
from outrider.models.static_step import STATIC_ARCHITECTURES
from outrider.spec.acceptance import VerifyRound
from outrider.spec.drafter import Draft, DrafterBase, Target
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.random_streams import PositionRandom
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams, warp
from outrider.testing.argmax_stable import assert_argmax_stable, greedy_with_gaps, near_tie_rate, verify_drift
from outrider.testing.contracts import BackendContract
from outrider.testing.tolerance import logit_tolerance
from outrider.testing.stats import chi2_test

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTION_SETS = {
    "compact-graphs": {},
    "compact-eager": {"graphs": False},
    "dense-eager": {"weights": "dense", "graphs": False},
}
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


class TestCudaContract(BackendContract):
    plugin_name = "cuda"


class TestCudaEagerContract(BackendContract):
    plugin_name = "cuda"
    plugin_options = {"graphs": False}


class TestCudaDenseContract(BackendContract):
    plugin_name = "cuda"
    plugin_options = {"weights": "dense", "graphs": False}


def _backend(options):
    from outrider.plugins.backends.cuda import CUDABackend

    return CUDABackend(**options)


@pytest.fixture(scope="module")
def cuda_models(outrider_contract_fixtures):
    out = {}
    for label, options in OPTION_SETS.items():
        backend = _backend(options)
        for arch in STATIC_ARCHITECTURES:
            out[label, arch] = backend.load_model(GGUFFile(outrider_contract_fixtures.model_path(arch)))
    return out


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("label", OPTION_SETS)
@pytest.mark.parametrize("arch", STATIC_ARCHITECTURES)
def test_parity_with_the_cpu_backend(cuda_models, outrider_contract_fixtures, label, arch):
    """Prompt, then steps of 1, 3 and 16 tokens: logits within bfloat16 tolerance of the float32 CPU backend."""
    from outrider.plugins.backends.cpu import CPUBackend

    model = cuda_models[label, arch]
    reference = CPUBackend(weights="dense").load_model(GGUFFile(outrider_contract_fixtures.model_path(arch)))
    vocab = reference.config.vocab_size
    cache, ref_cache = model.new_cache(64), reference.new_cache(64)
    start = 0
    for i, t in enumerate((12, 1, 3, 16)):
        tokens = _ids(t, vocab, i)
        want = reference.forward(tokens, start, ref_cache)
        got = model.forward(tokens.cuda(), start, cache).float().cpu()
        diff, bound = float((got - want).abs().max()), logit_tolerance(model.dtype, arch, want)
        assert diff <= bound, f"{label} {arch}: block {i} of {t} tokens: {diff:.3g} from the reference, bound {bound:.3g}"
        start += t


@pytest.mark.parametrize("label", OPTION_SETS)
@pytest.mark.parametrize("arch", STATIC_ARCHITECTURES)
def test_verify_blocks_of_every_size_match_single_steps(cuda_models, label, arch):
    model = cuda_models[label, arch]
    vocab = model.config.vocab_size
    for k in range(1, 17):
        prefix, block = _ids(5, vocab, k).cuda(), _ids(k, vocab, 100 + k).cuda()
        drift = verify_drift(model, prefix, block)
        bound = logit_tolerance(model.dtype, arch, model.forward(torch.cat([prefix, block]), 0, model.new_cache(32)))
        assert drift <= bound, f"{label} {arch}: k={k}: drift {drift:.3g} beyond the bound {bound:.3g}"


class _NoisyOracleDrafter(DrafterBase):
    """Proposes the plain greedy continuation with every seventh token wrong: long accepted blocks and
    rejections (so truncation) in one run."""

    def __init__(self, plain: list[int], prompt_len: int, vocab: int):
        self.plain, self.prompt_len, self.vocab = plain, prompt_len, vocab

    def propose(self, state, tokens: list[int], k: int) -> Draft:
        at = len(tokens) - self.prompt_len
        ids = self.plain[at:at + k]
        return Draft([(x + 1) % self.vocab if (at + i) % 7 == 6 else x for i, x in enumerate(ids)])


@pytest.mark.parametrize("label", OPTION_SETS)
@pytest.mark.parametrize("arch", STATIC_ARCHITECTURES)
def test_greedy_speculation_is_argmax_stable(cuda_models, outrider_contract_fixtures, label, arch):
    from outrider.plugins.acceptors.greedy import GreedyAcceptor

    model = cuda_models[label, arch]
    vocab = model.config.vocab_size
    n = 48
    plain, gaps = greedy_with_gaps(model, PROMPT, n)
    drift = max(verify_drift(model, torch.tensor(PROMPT).cuda(), _ids(k, vocab, k).cuda()) for k in (2, 5, 9, 16))
    # the margin comes from the oracle (what honest arithmetic in the model's dtype may move a logit by), not from
    # the drift of the code under test, which is printed beside it
    full = model.forward(torch.tensor(PROMPT).cuda(), 0, model.new_cache(len(PROMPT))).float().cpu()
    margin = logit_tolerance(model.dtype, arch, full)
    target = Target(model=model, tokenizer=None, gguf=None, backend=None)
    for draft_max in (4, 8, 15):
        drafter = _NoisyOracleDrafter(plain, len(PROMPT), vocab)
        drafter.setup(target)
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=128)
        got = list(runner.generate(list(PROMPT), n, SamplingParams(temperature=0.0)))
        verdict = assert_argmax_stable(plain, got, gaps, margin, f"{label} {arch} draft_max {draft_max}")
        print(f"{label} {arch} draft_max={draft_max}: drift {drift:.3g}, margin {margin:.3g}, near-tie rate "
              f"{near_tie_rate(gaps, margin):.3f}, first difference {verdict.first_difference}, "
              f"accepted {runner.stats.accepted}/{runner.stats.drafted}")


def test_the_sampled_acceptor_keeps_the_gpu_targets_distribution(cuda_models):
    """Speculative sampling over logits the GPU computed: the first emitted token is distributed as the
    target's warped distribution (chi-square), with drafts drawn from an unrelated q."""
    from outrider.plugins.acceptors.sampled import SampledAcceptor

    model = cuda_models["compact-graphs", "llama"]
    vocab = model.config.vocab_size
    cache = model.new_cache(64)
    model.forward(torch.tensor(PROMPT[:-1]).cuda(), 0, cache)
    logits = model.forward(torch.tensor(PROMPT[-1:] + [7]).cuda(), len(PROMPT) - 1, cache).float().cpu()
    params = SamplingParams(temperature=1.0, top_k=8)
    p = warp(logits[:1], params)[0].double().numpy()
    q = warp(torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2, params)
    acceptor, counts, n = SampledAcceptor(), np.zeros(vocab), 4000
    gen = torch.Generator().manual_seed(2)
    for seed in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        result = acceptor.accept(VerifyRound(logits, [x], q, params, PositionRandom(seed), len(PROMPT)))
        counts[result.tokens[0]] += 1
    stat, df, pval, forbidden = chi2_test(counts, p / p.sum())
    assert forbidden == 0 and pval > 1e-4, f"chi2={stat:.1f} df={df} p={pval:.2g}"


def test_a_draft_model_on_the_gpu_is_first_priced_by_its_share_of_layers(outrider_contract_fixtures):
    """Before any timing, draft-model prices a step on a GPU by its share of the target's layers (small steps there
    are bound by launches, not bytes): the tiny draft has 1 layer of the tiny llama's 2."""
    from outrider.io.tokenizer import Tokenizer
    from outrider.plugins.drafters.draft_model import DraftModelDrafter

    backend = _backend({})
    gguf = GGUFFile(outrider_contract_fixtures.tiny_llama_path)
    target = Target(model=backend.load_model(gguf), tokenizer=Tokenizer.from_gguf(gguf), gguf=gguf, backend=backend)
    drafter = DraftModelDrafter(model=str(outrider_contract_fixtures.tiny_draft_llama_path))
    drafter.setup(target)
    assert drafter.kind.cost == pytest.approx(1 / 2), drafter.kind


@pytest.mark.parametrize("learn", [False, True], ids=["mtp", "mtp-learning"])
@pytest.mark.parametrize("label", OPTION_SETS)
def test_mtp_speculation_on_the_gpu_is_argmax_stable(cuda_models, outrider_contract_fixtures, tmp_path, label, learn):
    """The `mtp` drafter over a GPU target (its head's block runs eagerly on the GPU beside the graphed trunk),
    drafting and, with `learn`, training every round: greedy output as plain greedy under the argmax-stable
    contract (a head of known random weights over the tiny llama: its drafts are mostly rejected, so every round
    rolls back both caches)."""
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.drafters.mtp.drafter import MTPDrafter
    from outrider.testing.tiny_models import write_tiny_mtp_sidecar

    model, path = cuda_models[label, "llama"], outrider_contract_fixtures.model_path("llama")
    write_tiny_mtp_sidecar(tmp_path / "head.gguf", "llama", path, seed=11, reduced=True)
    n = 48
    plain, gaps = greedy_with_gaps(model, PROMPT, n)
    full = model.forward(torch.tensor(PROMPT).cuda(), 0, model.new_cache(len(PROMPT))).float().cpu()
    margin = logit_tolerance(model.dtype, "llama", full)
    target = Target(model=model, tokenizer=None, gguf=GGUFFile(path), backend=None)
    learning = {"learn": True, "learn_share": 1.0, "learn_rows": 4, "learn_refresh": 1, "learn_lr": 3e-2}
    options = learning if learn else {}
    drafter = MTPDrafter(model=str(tmp_path / "head.gguf"), **options)
    drafter.setup(target)
    for draft_max in (2, "auto"):
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=128)
        got = list(runner.generate(list(PROMPT), n, SamplingParams(temperature=0.0)))
        verdict = assert_argmax_stable(plain, got, gaps, margin, f"{label} mtp learn={learn} draft_max {draft_max}")
        print(f"{label} mtp learn={learn} draft_max={draft_max}: first difference {verdict.first_difference}, "
              f"accepted {runner.stats.accepted}/{runner.stats.drafted}")
        assert runner.stats.drafted > 0
    if learn:
        assert drafter.learner.refreshes > 0
