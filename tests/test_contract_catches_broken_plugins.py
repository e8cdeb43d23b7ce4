"""The contract suite fails deliberately broken plugins, with messages that say what is wrong.

Fixtures: drafters each broken in one way (too many tokens, out-of-range ids, a different proposal on
every call, ignoring rollback, a draft kind that says there is nothing to draft when there is, a sequence's
context kept on the instance, the old one-sequence API) and
acceptors that claim `lossless = True` but are not (a Leviathan rule that resamples from p instead of the
residual; p-min), and a bigram drafter that gives q (a plugin author's first drafter: argmax drafts with a
soft q; one that keeps its rejected drafts; the correct one, which passes). They are caught by the check
functions, through
the pytest contract classes (pytester) and through `outrider check`.
"""

from __future__ import annotations

import types

import pytest
import torch
from click.testing import CliRunner

from outrider.hookspecs import hookimpl
from outrider.models.layers import PREFILL_CHUNK
from outrider.plugins.acceptors.pmin import PMinAcceptor
from outrider.plugins.backends.cpu import CPUBackend
from outrider.registry import build_registry
from outrider.spec.drafter import Draft, DrafterBase
from outrider.spec.sampling import sample_at, warp
from outrider.testing.checks import CHECKS, Subject
from outrider.testing.report import run_check, run_contract

pytest_plugins = ("pytester",)


class BrokenDrafter(DrafterBase):
    """Proposes the context's continuation 5, 6, 7, ... but with one deliberate flaw."""

    FLAWS = ("too-many", "out-of-range", "nondeterministic", "ignores-rollback", "kind-says-none", "shares-a-sequence")

    def __init__(self, flaw: str = "too-many"):
        self.flaw, self.calls, self.seen, self.last = flaw, 0, [], None

    def propose(self, state, tokens, k):
        self.calls += 1
        ids = [(tokens[-1] + 1 + i) % 200 for i in range(k)]
        if self.flaw == "shares-a-sequence":  # the last context it saw, on the instance: any sequence's
            ids = [(t + (self.last or 0)) % 200 for t in ids]
            self.last = tokens[0]
        if self.flaw == "too-many":
            ids += [1, 2]
        elif self.flaw == "out-of-range" and ids:
            ids[-1] = 100_000
        elif self.flaw == "nondeterministic":
            ids = [(t + self.calls) % 200 for t in ids]
        elif self.flaw == "ignores-rollback":
            self.seen += ids  # treats its own drafts as accepted context, whatever rollback says
            ids = [(t + len(self.seen)) % 200 for t in ids]
        return Draft(ids)

    def draft_kind(self, state, tokens):
        return None if self.flaw == "kind-says-none" else super().draft_kind(state, tokens)


class OneSequenceDrafter:
    """A drafter written to the API before it became per sequence: begin keeps the sequence on the instance."""

    needs = frozenset()

    def setup(self, target):
        pass

    def begin(self, prompt, params, controls):
        self.tokens = list(prompt)

    def propose(self, tokens, k):
        return Draft(tokens[-k:])

    def rollback(self, length):
        pass


class BigramDrafter(DrafterBase):
    """The plugin author's first drafter: q_i = the frequencies of what followed the last token in the context,
    add-one smoothed over the context's tokens (warped like the target's). `flaw` "soft-q" proposes the most frequent successor but returns that soft q
    (the bug: a q for a token not drawn from it); "ignores-rollback" keeps its own drafts as context; None
    draws each draft from q with the drafter stream of PositionRandom (correct)."""

    gives_draft_probs = True

    def __init__(self, flaw: str | None = None):
        self.flaw, self.extra = flaw, []

    def begin(self, prompt, params, controls):
        self.extra = []
        return super().begin(prompt, params, controls)

    def _q(self, state, context):
        counts = torch.full((self.target.model.config.vocab_size,), 1e-3)
        counts[context] = 1.0  # add-one smoothing over the tokens of the context
        for a, b in zip(context, context[1:]):
            if a == context[-1]:
                counts[b] += 1.0
        return warp(counts.log(), state.params)

    def propose(self, state, tokens, k):
        context, ids, rows = list(tokens) + self.extra, [], []
        for i in range(k):
            q = self._q(state, context)
            x = int(q.argmax()) if self.flaw == "soft-q" else sample_at(q, state.draws.uniform_draft(len(context)))
            ids.append(x)
            rows.append(q)
            context.append(x)
        if self.flaw == "ignores-rollback":
            self.extra += ids
        return Draft(ids, torch.stack(rows) if rows else None)


class StopsWheneverAskedDrafter(BigramDrafter):
    """The correct bigram drafter, except that any confidence stop asked of it stops every draft: the laws it
    is checked under then come from plain sampling, and so would pass whatever its drafts did."""

    def propose(self, state, tokens, k):
        return Draft() if state.controls.draft_p_min > 0 else super().propose(state, tokens, k)


class WrongResidualAcceptor:
    """Leviathan acceptance, but at a rejection it resamples from p instead of norm(max(0, p - q))."""

    lossless = True
    needs_draft_probs = False

    def accept(self, verify):
        p, rng, position = warp(verify.target_logits, verify.params), verify.rng, verify.position
        for i, x in enumerate(verify.draft_tokens):
            valid = verify.in_vocabulary(i)
            qx = float(verify.draft_probs[i, x]) if valid and verify.draft_probs is not None else 1.0
            if not (valid and rng.uniform_aux(position + i) * qx <= float(p[i, x])):
                return verify.recovered(i, sample_at(p[i], rng.uniform(position + i)))
        return verify.bonus(sample_at(p[verify.k], rng.uniform(position + verify.k)))


class LosslessClaimingPMin(PMinAcceptor):
    lossless = True  # false: p-min keeps any draft the target gives >= p_min


def _results(kind, make, fixtures):
    return {r.check.name: r for r in run_contract(Subject(kind, "broken", make, {}, fixtures))}


@pytest.mark.parametrize("flaw,check,fragment", [
    ("too-many", "never_more_than_k_tokens", "returned 3 tokens, more than k=1"),
    ("out-of-range", "ids_inside_the_vocabulary", "outside the vocabulary [0, 265): [100000]"),
    ("nondeterministic", "same_proposal_for_the_same_state", "the same propose again gave"),
    ("ignores-rollback", "consistent_after_rollback", "a fresh instance shown only the kept tokens"),
    ("kind-says-none", "draft_kind_none_means_an_empty_draft", "said None (nothing to draft), but propose("),
    ("shares-a-sequence", "sequences_interleaved_draft_as_each_alone", "of 2 interleaved (propose), round 2"),
])
def test_broken_drafter_is_caught_with_a_readable_message(outrider_contract_fixtures, flaw, check, fragment):
    results = _results("drafter", lambda: BrokenDrafter(flaw), outrider_contract_fixtures)
    assert results[check].status == "FAIL", results[check]
    assert fragment in results[check].message, results[check].message
    # the runner's guard keeps even a broken drafter from changing greedy output
    assert results["greedy_output_equals_plain_decoding"].status == "PASS"


def test_a_drafter_of_the_one_sequence_api_is_refused_naming_the_fix(outrider_contract_fixtures):
    from outrider.errors import ConfigError
    from outrider.spec.drafter_traits import DrafterTraits

    with pytest.raises(ConfigError) as refused:
        DrafterTraits.of(OneSequenceDrafter())
    message = str(refused.value)
    assert "\n" not in message and "old one-sequence drafter API" in message, message
    assert "propose(self, state, tokens, k)" in message and "docs/plugins.md, 'Drafters'" in message, message
    results = _results("drafter", OneSequenceDrafter, outrider_contract_fixtures)
    assert results["never_more_than_k_tokens"].status == "FAIL"
    assert "old one-sequence drafter API" in results["never_more_than_k_tokens"].message


def _checks(names, make, fixtures):
    subject = Subject("drafter", "bigram", make, {}, fixtures)
    return {check.name: run_check(check, subject) for check in CHECKS["drafter"] if check.name in names}


def test_a_soft_q_for_argmax_drafts_is_caught(outrider_contract_fixtures):
    results = _checks({"lossless_with_its_draft_probabilities", "probability_rows_sum_to_one"},
                      lambda: BigramDrafter("soft-q"), outrider_contract_fixtures)
    check = results["lossless_with_its_draft_probabilities"]
    assert check.status == "FAIL", check
    assert "are not distributed as plain sampling from the target: chi2=" in check.message, check.message
    assert "a q for tokens picked another way (argmax, lookup) breaks losslessness" in check.message
    # the checks that passed it before still pass it: only the new one sees the fault
    assert results["probability_rows_sum_to_one"].status == "PASS"


def test_a_q_drafter_that_ignores_rollback_is_caught(outrider_contract_fixtures):
    results = _checks({"consistent_after_rollback"}, lambda: BigramDrafter("ignores-rollback"),
                      outrider_contract_fixtures)
    check = results["consistent_after_rollback"]
    assert check.status == "FAIL", check
    assert "its state still holds the rejected drafts" in check.message, check.message


def test_a_bigram_drafter_that_samples_from_its_q_passes(outrider_contract_fixtures):
    results = _results("drafter", BigramDrafter, outrider_contract_fixtures)
    assert {name: r.status for name, r in results.items() if r.status == "FAIL"} == {}, results
    assert results["lossless_with_its_draft_probabilities"].status == "PASS"
    assert results["consistent_after_rollback"].status == "PASS"


def test_a_law_check_under_which_nothing_is_drafted_fails(outrider_contract_fixtures):
    results = _checks({"lossless_with_draft_p_min", "lossless_with_its_draft_probabilities"},
                      StopsWheneverAskedDrafter, outrider_contract_fixtures)
    check = results["lossless_with_draft_p_min"]
    assert check.status == "FAIL", check
    assert "the drafter drafted 0 tokens in 2000 seeded generations" in check.message, check.message
    assert "must draft at least 150 tokens" in check.message, check.message
    assert results["lossless_with_its_draft_probabilities"].status == "PASS"


@pytest.mark.parametrize("make", [WrongResidualAcceptor, LosslessClaimingPMin])
def test_lossy_acceptor_claiming_lossless_is_caught(outrider_contract_fixtures, make):
    from outrider.testing.checks import lossless_in_distribution

    with pytest.raises(AssertionError, match=r"differs from plain sampling from the target: chi2=.* p="):
        lossless_in_distribution(Subject("acceptor", make.__name__, make, {}, outrider_contract_fixtures))


def test_pmin_claiming_lossless_breaks_the_argmax_chain(outrider_contract_fixtures):
    from outrider.testing.checks import greedy_is_the_argmax_chain

    with pytest.raises(AssertionError, match="the argmax chain gives"):
        greedy_is_the_argmax_chain(Subject("acceptor", "p-min", LosslessClaimingPMin, {}, outrider_contract_fixtures))


def test_contract_class_reports_the_failure_through_pytest(pytester):
    pytester.makepyfile(test_broken_plugin='''
        from outrider.spec.drafter import Draft, DrafterBase
        from outrider.testing.contracts import DrafterContract

        class TooMany(DrafterBase):
            def propose(self, state, tokens, k):
                return Draft([5] * (k + 2))

        class TestTooMany(DrafterContract):
            def make_drafter(self):
                return TooMany()
    ''')
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "never_more or ids_inside or probability")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*TestTooMany.test_never_more_than_k_tokens*", "*returned 3 tokens, more than k=1*"])


@pytest.fixture
def registry_with_broken_plugins(monkeypatch):
    module = types.ModuleType("broken_plugins")
    module.register_drafters = hookimpl(lambda register: register(
        "broken", BrokenDrafter, options={"flaw": (str, "which flaw")}))
    module.register_acceptors = hookimpl(lambda register: register("lossy-but-claims-lossless", WrongResidualAcceptor))
    registry = build_registry(third_party=False)
    registry.add_plugin(module, "broken_plugins", "broken-plugins 0.0 (test fixture)")
    registry.plugins = {kind: {} for kind in registry.plugins}  # collect again, with the fixture module
    registry._aliases = {kind: {} for kind in registry.plugins}
    registry.collect()
    import outrider.registry

    monkeypatch.setattr(outrider.registry, "default_registry", lambda: registry)
    return registry


def test_outrider_check_reports_a_broken_drafter(registry_with_broken_plugins):
    from outrider.cli import main

    result = CliRunner().invoke(main, ["check", "broken", "-o", "flaw", "out-of-range"])
    assert result.exit_code == 1, result.output
    assert "drafter 'broken' from broken-plugins 0.0 (test fixture)" in result.output
    assert "FAIL  ids_inside_the_vocabulary" in result.output
    assert "proposed ids outside the vocabulary" in result.output
    assert "Traceback" not in result.output


def test_outrider_check_reports_a_lossy_acceptor_claiming_lossless(registry_with_broken_plugins):
    from outrider.cli import main

    result = CliRunner().invoke(main, ["check", "lossy-but-claims-lossless", "--kind", "acceptor"])
    assert result.exit_code == 1, result.output
    assert "FAIL  lossless_in_distribution" in result.output
    assert "PASS  greedy_is_the_argmax_chain" in result.output


def test_outrider_check_unknown_name_is_one_line():
    from outrider.cli import main

    result = CliRunner().invoke(main, ["check", "no-such-plugin"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown plugin 'no-such-plugin'; installed backends:")
    assert "drafters:" in lines[0] and "lookup" in lines[0]


class LastOnlyKeepsTheFirstChunkBackend(CPUBackend):
    """A CPU backend whose chunked prefill, asked for the last row only, returns the first chunk's last row."""

    def load_model(self, g):
        model = super().load_model(g)
        forward = model.forward

        def broken(tokens, start, cache, *args, last_only=False, **kwargs):
            out = forward(tokens, start, cache, *args, last_only=False, **kwargs)
            return out[PREFILL_CHUNK - 1:PREFILL_CHUNK] if last_only and len(tokens) > PREFILL_CHUNK else \
                (out[-1:] if last_only else out)

        model.forward = broken
        return model


def test_last_only_returning_a_row_of_the_first_chunk_is_caught(outrider_contract_fixtures):
    from outrider.testing.checks import last_only_gives_the_last_row

    with pytest.raises(AssertionError, match="last_only row vs the full forward's last row"):
        last_only_gives_the_last_row(Subject("backend", "broken", LastOnlyKeepsTheFirstChunkBackend, {},
                                             outrider_contract_fixtures))
