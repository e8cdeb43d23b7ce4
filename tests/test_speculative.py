"""The speculative loop: every drafter with a lossless acceptor reproduces plain decoding.

Oracles (from outrider.testing.fixtures, the one copy the contract checks use too): plain greedy decoding
as the obvious loop (a fresh full forward per token, no cache reuse, no drafter), which the engine tests
tie to transformers; for sampling, plain sampling with the same per-position uniforms.
"""

from __future__ import annotations

import random

import pytest

from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.plugins.drafters.draft_model import DraftModelDrafter
from outrider.plugins.drafters.lookup import LookupDrafter
from outrider.plugins.drafters.none import NoDrafter
from outrider.spec.drafter import Draft, DraftControls, DrafterBase
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams
from outrider.testing.fixtures import cpu_target, plain_greedy, plain_sampled
from outrider.testing.tiny_models import write_tiny_gemma3, write_tiny_gemma4, write_tiny_llama


def run(target, drafter, acceptor, prompt, n, params=SamplingParams(), draft_max=4, controls=None):
    drafter.setup(target)
    runner = Runner(target, drafter, acceptor, DrafterTraits.of(drafter, draft_max=draft_max), controls=controls, context=256)
    out = list(runner.generate(prompt, n, params))
    return out, runner.stats


class RandomDrafter(DrafterBase):
    """Adversarial: random ids, out-of-range ids, more tokens than asked, garbage probabilities."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.random = vocab_size, random.Random(seed)

    def propose(self, state, tokens, k):
        ids = [self.random.choice([self.random.randrange(self.vocab_size), -1, self.vocab_size + 5, tokens[-1]])
               for _ in range(k + 3)]
        return Draft(ids, None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    return {
        "llama": cpu_target(write_tiny_llama(folder / "llama.gguf", seed=0)),
        "llama_draft_path": write_tiny_llama(folder / "llama_draft.gguf", seed=1, n_layers=1),
        "gemma3": cpu_target(write_tiny_gemma3(folder / "gemma3.gguf", seed=0)),
        # a Gemma 4 target (per-layer inputs, KV-sharing layers) and a smaller gemma4 with its vocabulary
        "gemma4": cpu_target(write_tiny_gemma4(folder / "gemma4.gguf", seed=0)),
        "gemma4_draft_path": write_tiny_gemma4(folder / "gemma4_draft.gguf", seed=1, ffn=32, per_layer_input=32),
    }


# A prompt with repeats, so lookup has something to find.
TINY_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma4"])
@pytest.mark.parametrize("draft_max", [1, 4, 8, "auto"])
@pytest.mark.parametrize("drafter_name", ["none", "lookup", "draft-model", "random"])
def test_greedy_output_equals_plain_greedy(tiny, arch, draft_max, drafter_name):
    target = tiny[arch]
    if drafter_name == "draft-model" and arch == "gemma3":
        pytest.skip("no tiny draft model shares the tiny gemma3's vocabulary")
    drafter = {
        "none": lambda: NoDrafter(),
        "lookup": lambda: LookupDrafter(),
        # the tiny draft reads most of the tiny target's bytes (embeddings are most of both): priced as a real
        # pair's 0.5B beside its 1.5B, so that auto drafts
        "draft-model": lambda: DraftModelDrafter(p_min=0.0, model=str(tiny[f"{arch}_draft_path"]), step_cost=0.4),
        "random": lambda: RandomDrafter(target.model.config.vocab_size, seed=len(str(draft_max))),
    }[drafter_name]()
    expected = plain_greedy(target.model, TINY_PROMPT, 40)
    for acceptor in (GreedyAcceptor(), SampledAcceptor()):  # sampled at T=0 is `auto` at T=0
        out, stats = run(target, drafter, acceptor, TINY_PROMPT, 40, draft_max=draft_max)
        assert out == expected
        assert stats.generated_tokens == 40
        assert stats.rounds + 1 == 40 - stats.accepted  # each round emits accepted + 1; the first token is prefill's
        if drafter_name != "none":  # under auto, a drafter whose drafts are cleaned away is soon asked for none
            assert stats.drafted > 0 or (drafter_name == "random" and draft_max == "auto" and any(stats.chosen_lengths))


@pytest.mark.parametrize("drafter_name", ["lookup", "draft-model", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_seed_same_output_with_and_without_drafter(tiny, drafter_name, seed):
    target = tiny["llama"]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=seed)
    drafter = {
        # Sampled text from a random tiny model rarely repeats a bigram; 1-grams keep lookup drafting.
        "lookup": lambda: LookupDrafter(min_n=1),
        "draft-model": lambda: DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"])),
        "random": lambda: RandomDrafter(target.model.config.vocab_size, seed=seed),
    }[drafter_name]()
    expected = plain_sampled(target.model, TINY_PROMPT, 30, params)
    plain, _ = run(target, NoDrafter(), SampledAcceptor(), TINY_PROMPT, 30, params)
    speculative, stats = run(target, drafter, SampledAcceptor(), TINY_PROMPT, 30, params)
    assert plain == expected
    assert speculative == expected
    assert stats.drafted > 0


def test_metrics_are_the_spec_definitions_of_known_counts():
    """docs/acceptance.md's definitions on counts worked out by hand: 4 rounds drafting 4, 3, 3, 1 tokens and
    accepting 2, 3, 0, 1 of them (drafted 11 differs from emitted 10, so the rate tells the two apart)."""
    from outrider.spec.runner import GenerationStats

    stats = GenerationStats()
    for drafted, accepted in [(4, 2), (3, 3), (3, 0), (1, 1)]:
        stats.record_round(drafted, accepted)
    d = stats.as_dict()
    assert (d["rounds"], d["drafted"], d["accepted"]) == (4, 11, 6)
    assert d["acceptance_rate"] == round(6 / 11, 6)  # accepted / drafted, not accepted / emitted (6 / 10)
    assert d["mean_acceptance_length"] == 2.5  # 1 + 6 / 4: tokens per verify forward
    # position j: rounds that accepted it / rounds that drafted it: 3/4, 2/3, 1/3, 0/1
    assert d["per_position"] == [0.75, round(2 / 3, 6), round(1 / 3, 6), 0.0]


class OracleDrafter(DrafterBase):
    """Proposes the target's own greedy continuation (known in advance): every draft is accepted."""

    def __init__(self, continuation):
        self.continuation = continuation

    def propose(self, state, tokens, k):
        done = len(tokens) - len(TINY_PROMPT)
        return Draft(self.continuation[done:done + k])


def test_metrics_of_a_run_whose_drafts_are_all_right(tiny):
    target = tiny["llama"]
    want = plain_greedy(target.model, TINY_PROMPT, 41)
    out, stats = run(target, OracleDrafter(want), GreedyAcceptor(), TINY_PROMPT, 41, draft_max=4)
    d = stats.as_dict()
    assert out == want
    # 41 tokens: the first from the prefill, then rounds of 4 drafts + 1 bonus: 8 rounds, 32 accepted
    assert (d["rounds"], d["drafted"], d["accepted"]) == (8, 32, 32)
    assert d["acceptance_rate"] == 1.0 and d["mean_acceptance_length"] == 5.0 and d["per_position"] == [1.0] * 4


def test_draft_p_min_stops_low_confidence_drafts(tiny):
    target = tiny["llama"]
    drafter = DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"]))
    _, loose = run(target, drafter, GreedyAcceptor(), TINY_PROMPT, 30, draft_max=4)
    _, strict = run(target, drafter, GreedyAcceptor(), TINY_PROMPT, 30, draft_max=4,
                    controls=DraftControls(draft_p_min=0.99))
    assert strict.drafted < loose.drafted


def test_vocabulary_mismatch_is_refused(tiny, tmp_path):
    from outrider.errors import ConfigError

    gemma_path = write_tiny_gemma3(tmp_path / "g.gguf")
    drafter = DraftModelDrafter(p_min=0.0, model=str(gemma_path))
    with pytest.raises(ConfigError, match="same tokenizer"):
        drafter.setup(tiny["llama"])


# ------------------------------------------------------------------------------------------- real models

ECHO_PROMPT = ("Copy the following list exactly.\nalpha beta gamma delta epsilon zeta eta theta iota kappa\n"
               "alpha beta gamma delta epsilon zeta eta theta iota kappa\n")
OPEN_PROMPT = "The old lighthouse keeper looked at the sea and"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_target(request):
    return request.param, cpu_target(request.getfixturevalue(f"{request.param}_path"))


@pytest.mark.slow
@pytest.mark.parametrize("draft_max", [1, 4, 8])
def test_real_lookup_greedy_equals_plain(real_target, draft_max):
    _, target = real_target
    drafted = {}
    for text in (ECHO_PROMPT, OPEN_PROMPT):
        prompt = target.tokenizer.encode(text)
        plain, _ = run(target, NoDrafter(), GreedyAcceptor(), prompt, 40)
        spec, stats = run(target, LookupDrafter(), SampledAcceptor(), prompt, 40, draft_max=draft_max)
        assert spec == plain
        drafted[text] = stats.drafted
    assert drafted[ECHO_PROMPT] > 0  # the echo is what lookup drafts (open text may repeat nothing in 40 tokens)


@pytest.mark.slow
def test_real_draft_model_greedy_equals_plain(real_target, request):
    name, target = real_target
    # No smaller model of either family is on the registry; a bfloat16 copy of the target drafts for the
    # float32 target: close but not identical distributions, so some drafts are rejected.
    path = request.getfixturevalue(f"{name}_path")
    prompt = target.tokenizer.encode(OPEN_PROMPT)
    plain, _ = run(target, NoDrafter(), GreedyAcceptor(), prompt, 32)
    for draft_max in (1, 4, 8):
        drafter = DraftModelDrafter(p_min=0.0, model=str(path), dtype="bfloat16")
        drafter.setup(target)
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=256)
        assert list(runner.generate(prompt, 32, SamplingParams())) == plain
        assert runner.stats.accepted > 0


@pytest.mark.slow
def test_real_same_seed_same_output(real_target):
    _, target = real_target
    params = SamplingParams(temperature=0.7, seed=11)
    prompt = target.tokenizer.encode(ECHO_PROMPT)
    # 64 tokens: sampled text takes a while to start repeating itself, and the test needs accepted drafts
    plain, _ = run(target, NoDrafter(), SampledAcceptor(), prompt, 64, params)
    spec, stats = run(target, LookupDrafter(), SampledAcceptor(), prompt, 64, params, draft_max=6)
    assert spec == plain and stats.accepted > 0


def test_unseeded_runs_draw_their_drafts_afresh_and_seeded_runs_repeat_them():
    """A drafter's stream fixed across unseeded runs would make each context's sampled draft a constant,
    not a draw from q, and the Leviathan rule would then bias the output."""
    def draws(seed):
        state = DrafterBase().begin([1, 2], SamplingParams(1.0, seed=seed), DraftControls())
        return [state.draws.uniform_draft(i) for i in range(4)]

    assert draws(None) != draws(None)
    assert draws(7) == draws(7)


def test_rounds_are_what_generate_streams_one_record_per_forward(tiny):
    """Runner.rounds(): the prefill's round, then one per verify; each holds its accepted drafts plus one token
    (the last may be cut by the length limit), and the records add up to the stats and to generate's stream."""
    target, prompt, n = tiny["llama"], TINY_PROMPT, 40
    drafter = LookupDrafter()
    drafter.setup(target)
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=4), context=256)
    rounds = list(runner.rounds(prompt, n, SamplingParams()))
    stats = runner.stats
    assert [r.index for r in rounds] == list(range(len(rounds)))
    assert rounds[0].tokens and len(rounds[0].tokens) == 1 and rounds[0].drafted == 0
    assert len(rounds) == 1 + stats.rounds
    assert sum(r.drafted for r in rounds) == stats.drafted > 0
    assert sum(r.accepted for r in rounds) == stats.accepted > 0
    for r in rounds[1:-1]:
        assert len(r.tokens) == r.accepted + 1 and 0 <= r.accepted <= r.drafted <= r.chosen
    flat = [t for r in rounds for t in r.tokens]
    assert len(flat) == n == stats.generated_tokens
    assert flat == plain_greedy(target.model, prompt, n)
    assert flat == run(target, LookupDrafter(), GreedyAcceptor(), prompt, n)[0]


def test_draft_model_keeps_its_own_activations_and_threads_and_the_target_its_own(tmp_path):
    """A draft model loaded with its own activations and threads (int8, 1 thread) beside a target with others
    (float32, 2 threads) passes its own to each kernel call: the process's settings stay the target's through
    a generation (nothing is flipped around a draft forward), the draft model's logits are those of the same
    file run alone under the process-wide int8 setting, and the target's output is its float32 greedy one."""
    import torch

    from outrider import native
    from outrider.plugins.backends.cpu import CPUBackend
    from outrider.spec.drafter import Target
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer

    kernels = native.load()
    if not kernels.HAS_INT8_KERNELS:
        pytest.skip("this build has no int8 kernels (no AVX2)")
    threads = torch.get_num_threads()
    try:
        g = GGUFFile(write_tiny_llama(tmp_path / "target.gguf", seed=0))
        draft_path = write_tiny_llama(tmp_path / "draft.gguf", seed=1, n_layers=1)
        backend = CPUBackend(activations="float32", threads=2)
        target = Target(backend.load_model(g), Tokenizer.from_gguf(g), g, backend)
        drafter = DraftModelDrafter(p_min=0.0, model=str(draft_path), activations="int8", threads=1)
        drafter.setup(target)
        assert (kernels.int8_activations(), torch.get_num_threads()) == (False, 2)  # put back after loading
        seen = {"draft": set(), "target": set()}
        for name, model in (("draft", drafter.model), ("target", target.model)):
            def spy(*args, _forward=model.forward, _name=name, **kwargs):
                seen[_name].add((kernels.int8_activations(), torch.get_num_threads()))
                return _forward(*args, **kwargs)
            model.forward = spy
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=4), context=256)
        out = list(runner.generate(TINY_PROMPT, 24, SamplingParams()))
        assert runner.stats.drafted > 0
        assert seen == {"draft": {(False, 2)}, "target": {(False, 2)}}
        assert out == plain_greedy(target.model, TINY_PROMPT, 24)  # float32 target: the float32 oracle's tokens

        ids = torch.tensor(TINY_PROMPT)
        pinned = drafter.model.forward(ids, 0, drafter.model.new_cache(64))
        alone = CPUBackend(activations="int8").load_model(GGUFFile(draft_path))  # int8 for the process now
        assert torch.equal(pinned, alone.forward(ids, 0, alone.new_cache(64)))
        native.use_activations("float32")
        assert not torch.equal(pinned, alone.forward(ids, 0, alone.new_cache(64)))  # the check tells the modes apart
    finally:
        torch.set_num_threads(threads)
        native.use_activations("auto")


def test_draft_model_with_a_reduced_head_drafts_only_its_rows_and_stays_lossless(tiny):
    """`head_rows = N`: every drafted token is one of the head's first N rows (the tiny vocabulary has no
    control tokens past them), and the output is still plain greedy's."""
    target = tiny["llama"]
    rows = 40
    drafter = DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"]), head_rows=rows)
    drafter.setup(target)
    drafted = []
    propose = drafter.propose

    def spy(state, tokens, k):
        draft = propose(state, tokens, k)
        drafted.extend(draft.tokens)
        return draft
    drafter.propose = spy
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=4), context=256)
    out = list(runner.generate(TINY_PROMPT, 40, SamplingParams()))
    assert out == plain_greedy(target.model, TINY_PROMPT, 40)
    assert drafted and max(drafted) < rows
    full = DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"]))
    full.setup(target)
    state = full.begin(TINY_PROMPT, SamplingParams(), DraftControls())
    assert any(t >= rows for t in full.propose(state, TINY_PROMPT + out[:1], 16).tokens)  # the whole head's would not


def test_draft_model_stops_where_unsure_unless_told_otherwise(tiny):
    """The draft model's confidence stop (`-o drafter.p_min`, 0.75 by default) applies where --draft-p-min is not
    given; a given --draft-p-min wins; 0 turns it off; a value outside [0, 1) is refused in one line."""
    from outrider.errors import ConfigError

    def controls_used(drafter, given):
        drafter.setup(tiny["llama"])
        return drafter.begin(list(TINY_PROMPT), SamplingParams(), given).controls.draft_p_min

    path = str(tiny["llama_draft_path"])
    assert controls_used(DraftModelDrafter(model=path), DraftControls()) == 0.75
    assert controls_used(DraftModelDrafter(model=path), DraftControls(draft_p_min=0.3)) == 0.3
    assert controls_used(DraftModelDrafter(model=path, p_min=0.0), DraftControls()) == 0.0
    # the tiny draft model is unsure everywhere (its largest probability stays below 0.75): it drafts nothing
    out, stats = run(tiny["llama"], DraftModelDrafter(model=path), GreedyAcceptor(), TINY_PROMPT, 20, draft_max=4)
    assert out == plain_greedy(tiny["llama"].model, TINY_PROMPT, 20) and stats.drafted == 0
    with pytest.raises(ConfigError, match="p_min") as e:
        DraftModelDrafter(model=path, p_min=1.5)
    assert "\n" not in str(e.value)


class NoisyDrafter(DrafterBase):
    """Proposes the run's own output (known in advance) with every third position wrong: long drafts whose head
    is accepted and whose tail is not, so rounds end with 0 < accepted < drafted."""

    def __init__(self, continuation, vocab_size):
        self.continuation, self.vocab_size = continuation, vocab_size

    def propose(self, state, tokens, k):
        done = len(tokens) - len(TINY_PROMPT)
        right = self.continuation[done:done + k]
        return Draft([(t + 1) % self.vocab_size if (done + i) % 3 == 2 else t for i, t in enumerate(right)])


class RecordingAcceptor:
    """An acceptor as it is, with each round's (drafted, accepted) written down."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []
        self.lossless = getattr(inner, "lossless", True)

    def accept(self, verify):
        result = self.inner.accept(verify)
        self.rounds.append((len(verify.draft_tokens), result.accepted))
        return result


@pytest.mark.parametrize("acceptor_name", ["greedy", "sampled", "p-min"])
def test_rounds_that_accept_part_of_a_draft_keep_every_acceptors_output(tiny, acceptor_name):
    from outrider.plugins.acceptors.pmin import PMinAcceptor

    target = tiny["llama"]
    params = SamplingParams() if acceptor_name == "greedy" else SamplingParams(temperature=0.8, seed=5)
    want = (plain_greedy(target.model, TINY_PROMPT, 30) if acceptor_name == "greedy"
            else plain_sampled(target.model, TINY_PROMPT, 30, params))
    inner = {"greedy": GreedyAcceptor, "sampled": SampledAcceptor, "p-min": lambda: PMinAcceptor(p_min=0.99)}
    acceptor = RecordingAcceptor(inner[acceptor_name]())
    out, _ = run(target, NoisyDrafter(want, target.model.config.vocab_size), acceptor, TINY_PROMPT, 30, params)
    partial = [r for r in acceptor.rounds if 0 < r[1] < r[0]]
    assert len(partial) >= 3, acceptor.rounds
    assert out == want  # p-min 0.99 keeps a wrong draft only where the target gives it that much: never here


def test_a_draft_model_says_the_rows_its_next_draft_reads_before_drafting(tiny):
    """`catch_up_rows` is what the batch prices before asking for a draft, so it must be what `propose` reads: counted
    at the draft model's forwards, a draft of d tokens reads the catch-up, then one row a step (the last token's, then
    each draft but the last). Before the first draft the catch-up is the whole prompt; after a round whose drafts were
    kept, none; after each round that drafted nothing, one more."""
    drafter = DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"]))
    drafter.setup(tiny["llama"])
    model, read = drafter.model, []
    forward, forward_sequences = model.forward, model.forward_sequences
    model.forward = lambda ids, *a, **k: read.append(len(ids)) or forward(ids, *a, **k)
    model.forward_sequences = lambda ids, *a, **k: read.append(len(ids)) or forward_sequences(ids, *a, **k)
    state = drafter.begin(TINY_PROMPT, SamplingParams(), DraftControls())
    tokens = [*TINY_PROMPT, 7]

    def drafted_reads(tokens, k):
        rows, read[:] = drafter.catch_up_rows(state, tokens), []
        draft = drafter.propose(state, tokens, k)
        assert sum(read) == rows + len(draft.tokens), (rows, read, draft)
        return rows, draft.tokens

    rows, draft = drafted_reads(tokens, 3)
    assert rows == len(TINY_PROMPT) and len(draft) == 3
    drafter.rollback(state, len(tokens) + 1)  # the first draft kept, then another token
    tokens = [*tokens, draft[0], 11]
    assert drafted_reads(tokens, 2)[0] == 0
    drafter.rollback(state, len(tokens))  # nothing kept: the recovered token is the next draft step's row
    tokens = [*tokens, 12]
    assert drafter.catch_up_rows(state, tokens) == 0
    tokens = [*tokens, 13, 14, 15]  # three rounds without drafts
    assert drafter.catch_up_rows(state, tokens) == 3
    assert drafted_reads(tokens, 2)[0] == 3


def test_finishing_a_sequence_twice_is_finishing_it_once(tiny):
    """A host may finish a sequence its prefill already finished (a failed read): its pooled cache is given back
    once and its length counted once in what generations typically run to (hand-computed running means: a second
    finish of `a` after `b`'s would move the mean back towards 4)."""
    drafter = DraftModelDrafter(p_min=0.0, model=str(tiny["llama_draft_path"]))
    drafter.setup(tiny["llama"])
    runner = Runner(tiny["llama"], drafter, GreedyAcceptor(), DrafterTraits.of(drafter), context=64)
    a, _ = runner.start(TINY_PROMPT, 4, SamplingParams())
    b, _ = runner.start(TINY_PROMPT[:5], 2, SamplingParams())
    for seq in (a, b):
        while not seq.done:
            runner.step([seq])
    runner.finish(a)
    assert runner.typical_output == 4 and len(runner._free_caches) == 1
    runner.finish(b)
    runner.finish(a)
    assert runner.typical_output == pytest.approx(4 + 0.2 * (2 - 4)) and len(runner._free_caches) == 2


def test_a_sequence_admitted_after_others_starts_from_what_they_measured(tiny):
    """A server's requests each get a policy of their own; the next one starts from the costs the finished ones
    measured (`Runner.memory`)."""
    drafter = LookupDrafter()
    drafter.setup(tiny["llama"])
    runner = Runner(tiny["llama"], drafter, GreedyAcceptor(), DrafterTraits.of(drafter), context=64)
    seq, _ = runner.start(TINY_PROMPT * 2, 24, SamplingParams())
    while not seq.done:
        runner.step([seq])
    runner.finish(seq)
    assert seq.draft_length.measured and runner.memory.verify_s
    after = runner.admit(TINY_PROMPT, 8, SamplingParams())
    assert after.draft_length.verify_s == runner.memory.verify_s
    assert after.draft_length.draft_s_per_token == runner.memory.draft_s_per_token is not None
    runner.finish(after)


class KnowingDrafter(DrafterBase):
    """Drafts the continuation it was told (plain greedy's): every draft is right, so a policy free to choose drafts."""

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.prompt, self.continuation = prompt, continuation

    def propose(self, state, tokens, k):
        made = len(tokens) - len(self.prompt)
        return Draft(self.continuation[made:made + k], None)


def test_a_step_someone_waits_on_drafts_nothing_where_timings_choose_the_length(tiny):
    """`step(waited_on=True)` (a request waits for the step: the server reads a prompt between steps) is a plain
    step for a sequence whose draft length the timings choose, and still plain greedy's tokens; a fixed
    --draft-max keeps its drafts, and without waiting the same sequence drafts (so the test can fail)."""
    target, n = tiny["llama"], 24
    expected = plain_greedy(target.model, TINY_PROMPT, n)
    drafter = KnowingDrafter(TINY_PROMPT, expected)

    def drafted(waited_on: bool, draft_max) -> tuple[list[int], list[int]]:
        runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=64)
        seq, _ = runner.start(TINY_PROMPT, n, SamplingParams())
        lengths = []
        while not seq.done:
            lengths.append(runner.step([seq], waited_on=waited_on)[0].drafted)
        runner.finish(seq)
        return seq.output, lengths

    out, lengths = drafted(True, "auto")
    assert out == expected and set(lengths) == {0}, lengths
    out, lengths = drafted(True, 3)
    assert out == expected and max(lengths) == 3, lengths
    out, lengths = drafted(False, "auto")
    assert out == expected and max(lengths) > 0, lengths
