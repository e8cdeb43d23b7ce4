"""Seeded runs reproduce whatever the draft-length policy: with a drafter that gives q, `--draft-max auto`
chooses the lengths from a fixed cost model (not from timings, which differ from run to run), because the
lengths change the tokens such a run emits. Timings are made to differ on purpose here: a fake clock makes
long verifies cheap in one run and dear in the other."""

from __future__ import annotations

import json

from click.testing import CliRunner

import outrider.spec.runner as runner_module
from outrider.cli import main
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.plugins.drafters.draft_model import DraftModelDrafter
from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
PARAMS = SamplingParams(0.9, seed=42)


class FakeClock:
    """perf_counter for the runner: a target forward over n tokens costs `verify(n)` seconds, nothing else."""

    def __init__(self, verify):
        self.now, self.verify = 0.0, verify

    def perf_counter(self) -> float:
        return self.now

    def timed(self, forward):
        def wrapped(tokens, *args, **kwargs):
            self.now += self.verify(len(tokens))
            return forward(tokens, *args, **kwargs)
        return wrapped


def _run(fixtures, drafter, verify, monkeypatch, params=PARAMS, n=40):
    clock = FakeClock(verify)
    monkeypatch.setattr(runner_module, "time", clock)
    target = fixtures.target("llama")
    monkeypatch.setattr(target.model, "forward", clock.timed(type(target.model).forward.__get__(target.model)))
    drafter.setup(target)
    runner = Runner(target, drafter, SampledAcceptor(), DrafterTraits.of(drafter, draft_max="auto"), context=128)
    tokens = list(runner.generate(list(PROMPT), n, params))
    monkeypatch.undo()
    return tokens, runner.stats.chosen_lengths


STEEP = lambda n: 1.0 + 2.0 * (n - 1)  # noqa: E731; every extra verified token costs two single steps
FLAT = lambda n: 1.0 + 0.01 * (n - 1)  # noqa: E731


def test_a_q_drafter_under_auto_reproduces_whatever_the_timings(outrider_contract_fixtures, monkeypatch):
    path = str(outrider_contract_fixtures.tiny_draft_llama_path)
    runs = [_run(outrider_contract_fixtures, DraftModelDrafter(p_min=0.0, model=path, sample=True), verify, monkeypatch)
            for verify in (STEEP, FLAT)]
    (tokens_a, lengths_a), (tokens_b, lengths_b) = runs
    assert lengths_a == lengths_b, "the chosen draft lengths followed the timings"
    assert tokens_a == tokens_b


def test_a_deterministic_drafter_still_prices_lengths_by_the_timings(outrider_contract_fixtures, monkeypatch):
    # its output is plain sampling's whatever the lengths, so measured costs may (and do) steer them
    runs = [_run(outrider_contract_fixtures, LookupDrafter(min_n=1), verify, monkeypatch) for verify in (STEEP, FLAT)]
    (tokens_a, lengths_a), (tokens_b, lengths_b) = runs
    assert tokens_a == tokens_b == outrider_contract_fixtures.plain_sampled("llama", PROMPT, 40, PARAMS)
    assert sum(lengths_a) < sum(lengths_b), (lengths_a, lengths_b)


def test_two_cli_runs_with_the_same_seed_a_q_drafter_and_auto_are_identical(outrider_contract_fixtures):
    fx = outrider_contract_fixtures
    args = ["generate", "-m", str(fx.tiny_llama_path), "--drafter", "draft-model", "--draft-model",
            str(fx.tiny_draft_llama_path), "-o", "drafter.sample", "true", "-o", "drafter.p_min", "0",
            "-o", "drafter.step_cost", "0.1",
            "--draft-max", "auto", "--temp", "0.9",
            "--seed", "7", "-n", "40", "--json", "one two one two one two one two"]
    outs = [json.loads(CliRunner().invoke(main, args).stdout) for _ in range(2)]
    assert outs[0]["stats"]["drafted"] > 0
    assert outs[0]["tokens"] == outs[1]["tokens"]


def test_a_chain_with_a_q_member_under_auto_reproduces_whatever_the_timings(outrider_contract_fixtures, monkeypatch):
    """`lookup,draft-model` gives q in the rounds its draft-model member drafts: its draft lengths change
    the tokens, so `auto` must not take them from timings, even though its lookup rounds give no q."""
    from outrider.spec.chain import DrafterChain

    path = str(outrider_contract_fixtures.tiny_draft_llama_path)
    chain = lambda: DrafterChain([LookupDrafter(min_n=2), DraftModelDrafter(p_min=0.0, model=path, sample=True)],  # noqa: E731
                                 ["lookup", "draft-model"])
    runs = [_run(outrider_contract_fixtures, chain(), verify, monkeypatch) for verify in (STEEP, FLAT)]
    (tokens_a, lengths_a), (tokens_b, lengths_b) = runs
    assert lengths_a == lengths_b, "the chosen draft lengths followed the timings"
    assert tokens_a == tokens_b
    assert chain().may_give_draft_probs and not chain().gives_draft_probs


def test_a_seeded_lookup_mtp_chain_gives_the_same_tokens_at_one_and_two_threads(outrider_contract_fixtures):
    fx = outrider_contract_fixtures
    base = ["generate", "-m", str(fx.tiny_llama_path), "--drafter", "lookup,mtp", "--draft-model",
            str(fx.tiny_mtp_sidecar_path), "--draft-max", "auto", "--temp", "0.7", "--seed", "1", "-n", "40", "--json",
            "one two one two one two one two"]
    outs = []
    for threads in ("1", "2", "1"):
        result = CliRunner().invoke(main, base + ["-o", "backend.threads", threads])
        assert result.exit_code == 0, result.output
        outs.append(json.loads(result.stdout))
    assert outs[0]["stats"]["drafted"] > 0
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"]
