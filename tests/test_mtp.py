"""The `mtp` drafter on sidecars this test writes itself in llama.cpp's nextn layout, with known random weights.

Oracles: the MTP equations (llama.cpp's nextn blocks: input norms, eh_proj, one decoder block, shared head) written out below in plain torch over
weights read back with the `gguf` package's own reader (not Outrider's), attention recomputed over every row
each step (no cache); plain decoding written as the obvious loop; exact target distributions for chi-square.
"""

from __future__ import annotations

import math
import random
import time

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from outrider.io.gguf import GGUFFile
from outrider.native import activations as native_activations
from outrider.plugins.acceptors.greedy import GreedyAcceptor
from outrider.plugins.acceptors.sampled import SampledAcceptor
from outrider.plugins.drafters.mtp.drafter import MTPDrafter
from outrider.spec.drafter import DraftControls
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams, warp
from outrider.testing.fixtures import ContractFixtures, plain_greedy
from outrider.testing.stats import chi2_test
from outrider.testing.tiny_models import DRAFT_VOCAB
from outrider.testing.tiny_models import write_tiny_mtp_sidecar as write_sidecar

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _t(reader_tensor) -> torch.Tensor:
    t = reader_tensor
    data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (0, 1) else np.asarray(t.data)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape([int(x) for x in reversed(t.shape)])


def read_all(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    meta = {f.name: f.contents() for f in r.fields.values()}
    return tensors, meta


# ------------------------------------------------------------------------------------------------ the oracle


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_norm(x, pos, base):  # llama as stored in GGUF: adjacent pairs (2i, 2i+1)
    d = x.shape[-1]
    theta = pos[:, None].double() * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = theta.cos().float()[:, None], theta.sin().float()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def rope_neox(x, pos, base):  # gemma: pairs (i, i + d/2)
    d = x.shape[-1]
    theta = pos[:, None].double() * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = theta.cos().float()[:, None], theta.sin().float()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class Oracle:
    def __init__(self, arch, target_path, sidecar_path):
        tt, meta = read_all(target_path)
        st, _ = read_all(sidecar_path)
        self.arch, self.meta = arch, meta
        get = lambda name: _t(st[name]) if name in st else _t(tt[name])
        self.n_trunk = int(meta[f"{arch}.block_count"])
        p = f"blk.{self.n_trunk}."
        self.w = {name[len(p):]: _t(t) for name, t in st.items() if name.startswith(p) and "draft_vocab" not in name}
        self.E = _t(tt["token_embd.weight"])
        self.head = get(p + "nextn.shared_head_head.weight") if p + "nextn.shared_head_head.weight" in st else \
            (_t(tt["output.weight"]) if "output.weight" in tt else self.E)
        self.head_norm = self.w.get("nextn.shared_head_norm.weight", _t(tt["output_norm.weight"]))
        self.ids = torch.from_numpy(np.asarray(st[p + "nextn.draft_vocab"].data).astype(np.int64)) \
            if p + "nextn.draft_vocab" in st else None
        self.eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.heads = int(meta[f"{arch}.attention.head_count"])
        self.kv = int(meta[f"{arch}.attention.head_count_kv"])
        self.hd = int(meta.get(f"{arch}.attention.key_length", self.E.shape[1] // self.heads))
        self.vocab = self.E.shape[0]

    def rows(self, toks, hs):
        """(full-vocab logits [T, V], post-norm hidden [T, H]) of MTP rows at positions 0..T-1."""
        w, eps, T = self.w, self.eps, len(toks)
        pos = torch.arange(T)
        e = rms(self.E[torch.tensor(toks)], w["nextn.enorm.weight"], eps)
        x = torch.cat([e, rms(hs, w["nextn.hnorm.weight"], eps)], -1) @ w["nextn.eh_proj.weight"].T
        a = rms(x, w["attn_norm.weight"], eps)
        q = (a @ w["attn_q.weight"].T).view(T, self.heads, self.hd)
        k = (a @ w["attn_k.weight"].T).view(T, self.kv, self.hd)
        v = (a @ w["attn_v.weight"].T).view(T, self.kv, self.hd)
        mask = pos[None, :] <= pos[:, None]
        if self.arch == "llama":
            q, k = rope_norm(q, pos, 10000.0), rope_norm(k, pos, 10000.0)
        else:  # block n_trunk = 6 of a period-6 pattern: local (window, base 1e4)
            q, k = rms(q, w["attn_q_norm.weight"], eps), rms(k, w["attn_k_norm.weight"], eps)
            q, k = rope_neox(q, pos, 10000.0), rope_neox(k, pos, 10000.0)
            mask = mask & (pos[:, None] - pos[None, :] < int(self.meta["gemma3.attention.sliding_window"]))
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.hd)
        o = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(T, -1)
        o = o @ w["attn_output.weight"].T
        if self.arch == "gemma3":
            x = x + rms(o, w["post_attention_norm.weight"], eps)
            f = rms(x, w["ffn_norm.weight"], eps)
            f = F.gelu(f @ w["ffn_gate.weight"].T, approximate="tanh") * (f @ w["ffn_up.weight"].T)
            f = f @ w["ffn_down.weight"].T
            x = x + rms(f, w["post_ffw_norm.weight"], eps)
        else:
            x = x + o
            f = rms(x, w["ffn_norm.weight"], eps)
            x = x + (F.silu(f @ w["ffn_gate.weight"].T) * (f @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
        h = rms(x, self.head_norm, eps)
        logits = h @ self.head.T
        if self.ids is not None:
            logits = torch.full((T, self.vocab), float("-inf")).scatter(1, self.ids.expand(T, -1), logits)
        return logits, h

    def draft_logits(self, tokens, target_hidden, drafted):
        """Logits of drafts 1..len(drafted)+1: the rows (x_p, h_{p-1}) of `tokens`, then the drafts chained."""
        hs = torch.cat([torch.zeros(1, target_hidden.shape[1]), target_hidden[: len(tokens) - 1]])
        toks, out = list(tokens), []
        for d in [None, *drafted]:
            if d is not None:
                toks.append(d)
                hs = torch.cat([hs, h[-1:]])
            logits, h = self.rows(toks, hs)
            out.append(logits[-1])
        return torch.stack(out)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return ContractFixtures(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def sidecars(fx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp-sidecars")
    paths = {"llama": folder / "llama.mtp.gguf", "gemma3": folder / "gemma3.mtp.gguf"}
    write_sidecar(paths["llama"], "llama", fx.model_path("llama"), seed=11, reduced=False)
    write_sidecar(paths["gemma3"], "gemma3", fx.model_path("gemma3"), seed=12, reduced=True)
    return paths


def _target_hidden(target, tokens):
    _, h = target.model.forward(torch.tensor(tokens), 0, target.model.new_cache(len(tokens)), hidden=True)
    return h


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_distributions_match_the_spec_equations(fx, sidecars, arch):
    target = fx.target(arch)  # loaded first: loading sets the backend's activations mode
    with native_activations("float32"):  # float32 throughout, as the oracle computes
        _check_draft_distributions(target, fx, sidecars, arch)


def _check_draft_distributions(target, fx, sidecars, arch):
    drafter = MTPDrafter(model=str(sidecars[arch]), sample=True)
    drafter.setup(target)
    params = SamplingParams(temperature=1.0, seed=3)
    t0 = 9
    tokens = PROMPT + [t0]
    state = drafter.begin(list(PROMPT), params, DraftControls())
    hidden = _target_hidden(target, tokens)
    drafter.observe(state, hidden[: len(PROMPT)], 0, None)
    draft = drafter.propose(state, list(tokens), 4)
    assert len(draft.tokens) == 4 and draft.probs.shape == (4, target.model.config.vocab_size)
    want = torch.softmax(Oracle(arch, fx.model_path(arch), sidecars[arch]).draft_logits(tokens, hidden,
                                                                                       draft.tokens[:-1]), -1)
    torch.testing.assert_close(draft.probs, want, atol=2e-5, rtol=1e-4)
    if arch == "gemma3":  # the reduced head: only its ids can be drafted
        assert (draft.probs > 0).sum(-1).max() <= DRAFT_VOCAB


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reject_then_continue_equals_a_fresh_run(fx, sidecars, arch):
    """After a round whose last drafts were rejected and rolled back, the MTP cache holds what a fresh drafter
    shown only the certain tokens builds, and both draft the same."""
    target = fx.target(arch)
    greedy = SamplingParams()
    a = MTPDrafter(model=str(sidecars[arch]))
    a.setup(target)
    sa = a.begin(list(PROMPT), greedy, DraftControls())
    tokens = PROMPT + [9]
    full = _target_hidden(target, tokens + [1, 2, 3])
    a.observe(sa, full[: len(PROMPT)], 0, None)
    first = a.propose(sa, list(tokens), 4).tokens
    n = len(tokens) - 1
    kept = first[:1]
    a.rollback(sa, n + 1 + len(kept))
    after = tokens + kept + [(first[1] + 1) % 200]  # the target's token: anything but the second draft
    certain = _target_hidden(target, after)
    a.observe(sa, certain[n: n + 1 + len(kept)], n, None)
    got = a.propose(sa, list(after), 4).tokens

    b = MTPDrafter(model=str(sidecars[arch]))
    b.setup(target)
    sb = b.begin(list(after[:-1]), greedy, DraftControls())
    b.observe(sb, certain[: len(after) - 1], 0, None)
    want = b.propose(sb, list(after), 4).tokens
    assert got == want
    ca, cb = sa.caches[0], sb.caches[0]
    assert ca.length == cb.length == len(after)
    torch.testing.assert_close(ca.values[0][:, : ca.length], cb.values[0][:, : cb.length], atol=1e-5, rtol=1e-5)


def _speculate(drafter, target, prompt, params, rounds, k=3):
    """One sequence's rounds through `drafter`, fed as the runner feeds it (its own target cache; after the prompt
    and after each round's rollback, the target's hidden rows of the tokens now certain), yielding (state, draft)
    each round. Round r keeps r mod (drafted + 1) of its drafts, then the target's token, so the rollbacks cut at
    every depth; the sequence is ended after its last round."""
    model = target.model
    cache = model.new_cache(len(prompt) + rounds * (k + 1) + 1)
    logits, hidden = model.forward(torch.tensor(prompt), 0, cache, hidden=True)
    tokens = list(prompt) + [int(logits[-1].argmax())]
    state = drafter.begin(list(prompt), params, DraftControls())
    try:
        drafter.observe(state, hidden, 0, cache)
        for r in range(rounds):
            n = len(tokens) - 1
            draft = drafter.propose(state, list(tokens), k)
            yield state, draft
            logits, hidden = model.forward(torch.tensor([tokens[-1], *draft.tokens]), n, cache, hidden=True)
            kept = r % (len(draft.tokens) + 1)
            cache.truncate(n + 1 + kept)
            drafter.rollback(state, n + 1 + kept)
            drafter.observe(state, hidden[: kept + 1], n, cache)
            tokens += draft.tokens[:kept] + [int(logits[kept].argmax())]
    finally:
        drafter.end(state)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_interleaved_sequences_get_the_drafts_each_gets_alone(fx, sidecars, arch):
    """One drafter, several sequences: a and b (different prompts and seeds) interleaved round by round, and c
    begun once a has ended (on the buffers a gave back, its rows stale past what c observes), each get exactly
    the drafts and q rows a fresh drafter gives it alone."""
    target = fx.target(arch)
    runs = {"a": ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], SamplingParams(temperature=1.0, seed=3), 4),
            "b": ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], SamplingParams(temperature=1.0, seed=8), 9),
            "c": ([7, 7, 2, 8, 1], SamplingParams(temperature=0.7, seed=5), 4)}

    def fresh():
        drafter = MTPDrafter(model=str(sidecars[arch]), sample=True)
        drafter.setup(target)
        return drafter

    alone = {name: [draft for _, draft in _speculate(fresh(), target, *run)] for name, run in runs.items()}
    shared = fresh()
    got = {name: [] for name in runs}
    live = {name: _speculate(shared, target, *runs[name]) for name in ("a", "b")}
    held = {}
    while live:
        for name, sequence in list(live.items()):
            try:
                state, draft = next(sequence)
            except StopIteration:
                del live[name]
                if name == "a":
                    live["c"] = _speculate(shared, target, *runs["c"])
                continue
            held.setdefault(name, state.hidden)
            got[name].append(draft)
    assert held["c"] is held["a"]  # c drafted on a's buffers
    for name in runs:
        assert len(got[name]) == len(alone[name]) == runs[name][2]
        assert any(d.tokens for d in got[name])
        for mine, want in zip(got[name], alone[name]):
            assert mine.tokens == want.tokens, name
            assert (mine.probs is None) == (want.probs is None), name
            assert mine.probs is None or torch.equal(mine.probs, want.probs), name


def test_the_forward_that_makes_the_first_draft_is_billed_as_a_draft_step(fx, sidecars, monkeypatch):
    """The catch-up forward of the rows a round accepted also makes the next round's first draft: `auto` prices
    one step of it as drafting (else a one-token draft looks free) and the rest as upkeep. Every head forward
    here takes 40 ms more per row, so a two-row catch-up is one step of drafting and one of upkeep."""
    target = fx.target("llama")
    drafter = MTPDrafter(model=str(sidecars["llama"]))
    drafter.setup(target)
    head = drafter.heads[0]
    forward = head.forward

    def slow_forward(tokens, hidden, start, cache):
        time.sleep(0.04 * len(tokens))
        return forward(tokens, hidden, start, cache)

    monkeypatch.setattr(head, "forward", slow_forward)
    tokens = PROMPT + [9]
    state = drafter.begin(list(PROMPT), SamplingParams(), DraftControls())
    hidden = _target_hidden(target, tokens + [1, 2])
    drafter.observe(state, hidden[: len(PROMPT)], 0, None)
    first = drafter.propose(state, list(tokens), 2)  # the prompt's catch-up, then a one-row step that times the step
    assert len(first.tokens) == 2 and first.upkeep_s >= 0.04 * (len(PROMPT) - 1)
    n = len(tokens) - 1
    drafter.rollback(state, n + 2)  # the first draft accepted: t0's row and the draft's are certain
    after = tokens + first.tokens[:1] + [(first.tokens[1] + 1) % 200]
    drafter.observe(state, _target_hidden(target, after)[n: n + 2], n, None)
    second = drafter.propose(state, list(after), 1)  # one forward of those two rows, which makes the draft
    assert len(second.tokens) == 1
    assert 0.02 < second.upkeep_s < 0.06, second.upkeep_s


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("draft_max", [2, "auto"])
def test_greedy_speculation_equals_plain_decoding(fx, sidecars, arch, draft_max):
    target = fx.target(arch)
    drafter = MTPDrafter(model=str(sidecars[arch]))
    drafter.setup(target)
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=256)
    out = list(runner.generate(list(PROMPT), 24, SamplingParams()))
    assert out == plain_greedy(target.model, PROMPT, 24)
    assert runner.stats.drafted > 0


def test_draft_p_min_stops_unsure_drafts(fx, sidecars):
    target = fx.target("llama")
    drafter = MTPDrafter(model=str(sidecars["llama"]))
    drafter.setup(target)
    tokens = PROMPT + [9]
    hidden = _target_hidden(target, tokens)
    lengths = []
    for p_min in (0.0, 0.999999):
        state = drafter.begin(list(PROMPT), SamplingParams(), DraftControls(draft_p_min=p_min))
        drafter.observe(state, hidden[: len(PROMPT)], 0, None)
        lengths.append(len(drafter.propose(state, list(tokens), 4).tokens))
    assert lengths == [4, 0]


def test_sampling_with_q_keeps_the_target_distribution(fx, tmp_path):
    """Chi-square over 500 seeded generations of 4 tokens: the joint law of the first three (the second and
    third drafted with q in one round, and verified) is exactly plain sampling's, from the target's own
    distributions. The head's reduced vocabulary is the tokens in play plus a few others, so drafts are
    sometimes accepted, sometimes not, and tokens outside it have q = 0."""
    _check_the_sampled_law(fx, tmp_path, {})


def test_a_learning_head_keeps_the_target_distribution(fx, tmp_path):
    """The same law while `drafter.learn` trains the head every round (a large learning rate) and rebuilds
    the drafting head after every step: each round's q is the head's that drafted it."""
    drafter = _check_the_sampled_law(fx, tmp_path, {"learn": True, "learn_share": 1.0, "learn_rows": 4,
                                                    "learn_refresh": 1, "learn_lr": 3e-2})
    assert drafter.learner.refreshes >= 400, drafter.learner.refreshes


def _check_the_sampled_law(fx, tmp_path, options):
    target, model = fx.target("llama"), fx.target("llama").model
    params = SamplingParams(temperature=1.5, top_k=3)
    prompt = PROMPT[:6]
    dist = lambda tokens: warp(model.forward(torch.tensor(tokens), 0, model.new_cache(16))[-1], params)
    cells, want = [], []
    p1 = dist(prompt)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = dist(prompt + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in torch.nonzero(p3).flatten().tolist():
                cells.append((a, b, c))
                want.append(float(p1[a] * p2[b] * p3[c]))
    ids = sorted({t for cell in cells for t in cell} | {0, 1, 2, 3})
    write_sidecar(tmp_path / "head.gguf", "llama", fx.model_path("llama"), seed=5, reduced=True, ids=ids)
    drafter = MTPDrafter(model=str(tmp_path / "head.gguf"), sample=True, **options)
    drafter.setup(target)
    runner = Runner(target, drafter, SampledAcceptor(), DrafterTraits.of(drafter, draft_max=2), context=64)
    counts = np.zeros(len(cells))
    accepted = drafted = 0
    for seed in range(500):  # on one thread: the suite's autouse fixture
        out = list(runner.generate(list(prompt), 4, SamplingParams(1.5, top_k=3, seed=seed)))
        counts[cells.index(tuple(out[:3]))] += 1
        accepted, drafted = accepted + runner.stats.accepted, drafted + runner.stats.drafted
    stat, df, pval, forbidden = chi2_test(counts, np.array(want))
    assert forbidden == 0 and pval > 1e-4, f"chi2={stat:.1f} df={df} p={pval:.2g}"
    assert drafted > 0 and 0 < accepted < drafted, (accepted, drafted)
    return drafter


# ------------------------------------------------------------------------------------------------ distill


@pytest.fixture(scope="module")
def distilled(fx, tmp_path_factory):
    from outrider.plugins.drafters.mtp.distill import DistillSettings, distill

    out = tmp_path_factory.mktemp("distill") / "tiny-llama.mtp.gguf"
    settings = DistillSettings(steps=15, generate_tokens=16, stdlib_chunks=1, draft_vocab=64, eval_tokens=0,
                               lr=3e-3, prompts=("Hello there", "def f(x):"), fresh=True, matrices="F16")
    return distill(str(fx.model_path("llama")), settings, out, echo=lambda line: None)


def test_distill_writes_its_answers_side_by_side_as_each_would_be_written_alone(fx):
    """distill's `generate` (several answers per step) against plain greedy decoding of each prompt: the same
    tokens for the greedy rows beside a sampled one, and a stop token ends only its own answer."""
    from outrider.plugins.drafters.mtp.distill import generate

    model, gen = fx.target("qwen2").model, torch.Generator().manual_seed(0)
    prompts = [[1, 5, 9], [2, 4, 6, 8, 10, 12, 14], [3]]
    expected = [fx.plain_greedy("qwen2", p, 6) for p in prompts]
    outs = generate(model, prompts, 6, [0.0, 0.7, 0.0], gen, set())
    assert [outs[0], outs[2]] == [expected[0], expected[2]] and len(outs[1]) == 6
    stop = next(t for i, t in enumerate(expected[0]) if i and expected[0].index(t) == i)  # not the first token
    ended = [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    assert 1 < len(ended[0]) < 6
    outs = generate(model, prompts, 6, [0.0, 0.7, 0.0], gen, {stop})  # row 2 keeps its temperature after row 0 ends
    assert [outs[0], outs[2]] == [ended[0], ended[2]]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_the_hidden_states_read_while_writing_are_those_a_forward_over_the_text_gives(fx, arch):
    """`generate(hidden=True)` keeps one row per token the target read (the prompt's, every answer token's but the
    last): a forward over prompt + answer, the teacher's other way to them, gives the same rows, and the teacher
    gives the same distributions from either. Answers that stop at a stop token and at the length both, several side
    by side and one alone (`forward_sequences` with three sequences and with one)."""
    from outrider.plugins.drafters.mtp.distill import generate, teacher

    model, gen = fx.target(arch).model, torch.Generator().manual_seed(0)
    prompts = [[1, 5, 9], [2, 4, 6, 8, 10, 12, 14], [3]]
    greedy = fx.plain_greedy(arch, prompts[0], 6)
    stop = {greedy[3]} - set(greedy[:3])  # the first answer ends early where it can
    vocab_ids = torch.arange(0, model.config.vocab_size, 3)
    draft_rows = model.output.rows(vocab_ids).float()
    for group, temperatures in ((prompts, [0.0, 0.7, 0.0]), (prompts[1:2], [0.0])):
        outs, rows = generate(model, group, 6, temperatures, gen, stop, hidden=True)
        if group is prompts:
            assert outs[0] == greedy[:4] if stop else len(outs[0]) == 6
        for prompt, out, h in zip(group, outs, rows):
            tokens = prompt + out[:-1]
            assert h.dtype == torch.float16 and h.shape == (len(tokens), model.config.hidden_size)
            read = teacher(model, tokens, draft_rows, top_k=4)
            kept = teacher(model, tokens, draft_rows, top_k=4, hidden=h)
            scale = read.hidden.float().abs().amax(-1, keepdim=True)  # per row: the norm's gains differ by channel
            assert ((kept.hidden.float() - read.hidden.float()).abs() <= 0.02 * scale).all()
            dense = lambda s: torch.zeros(len(tokens), len(vocab_ids)).scatter(1, s.top_ids, s.top_p)
            torch.testing.assert_close(dense(kept), dense(read), atol=0.02, rtol=0)


def test_the_teacher_cuts_kept_states_into_the_pieces_of_their_text(fx):
    """`teacher_split` over an answer with its kept states and a text without: every piece of the answer carries the
    very rows of its tokens (the answer cut to the rows it has: its last token was never read), the text's pieces
    a forward's, pieces under 8 tokens left out."""
    from outrider.plugins.drafters.mtp.distill import DistillSettings, generate, teacher_split

    model = fx.target("qwen2").model
    prompt = [2, 4, 6, 8, 10, 12, 14]
    outs, rows = generate(model, [prompt], 12, [0.0], torch.Generator(), set(), hidden=True)
    answer, text = prompt + outs[0], list(range(20, 37))  # 19 tokens and 18 rows; 17 tokens
    settings = DistillSettings(seq_len=8, top_k=4, held_out=0.5)
    held, train = teacher_split(model, [answer, text], [rows[0], None], torch.arange(0, model.config.vocab_size, 3),
                                settings, budget=1e6)
    samples = {tuple(s.tokens.tolist()): s for s in held + train}
    assert sorted(samples) == sorted([tuple(answer[0:8]), tuple(answer[8:16]), tuple(text[0:8]), tuple(text[8:16])])
    for j in (0, 8):
        assert torch.equal(samples[tuple(answer[j:j + 8])].hidden, rows[0][j:j + 8])
    _, forward = model.forward(torch.tensor(text[8:16]), 0, model.new_cache(8), hidden=True, last_only=True)
    torch.testing.assert_close(samples[tuple(text[8:16])].hidden, forward.half())


def test_the_teacher_stops_where_it_has_read_enough(fx):
    """With `enough`, `teacher_split` reads pieces in the corpus' order until it says the training pieces read (the
    held-out ones left out of the count) are enough: the piece that crossed the line is kept, none after it."""
    from outrider.plugins.drafters.mtp.distill import DistillSettings, teacher_split

    model = fx.target("qwen2").model
    texts = [list(range(20 + 10 * i, 28 + 10 * i)) for i in range(6)]  # six pieces of 8 tokens
    asked = []

    def enough(pieces):
        asked.append(pieces)
        return pieces >= 2

    held, train = teacher_split(model, texts, [None] * 6, torch.arange(0, model.config.vocab_size, 3),
                                DistillSettings(seq_len=8, top_k=4), budget=1e6, enough=enough)
    assert sorted(tuple(s.tokens.tolist()) for s in held + train) == [tuple(t) for t in texts[:3]]
    assert asked == [0, 1, 2] and len(held) == 1
    # with sources, whole ones held out: three of six pieces to hold, sources of two pieces each, so one source
    held, train = teacher_split(model, texts, [None] * 6, torch.arange(0, model.config.vocab_size, 3),
                                DistillSettings(seq_len=8, top_k=4, held_out=0.5), budget=1e6,
                                sources=["a", "a", "b", "b", "c", "c"])
    index = {tuple(t): i // 2 for i, t in enumerate(texts)}
    held_from = {index[tuple(s.tokens.tolist())] for s in held}
    assert len(held) == 2 and len(held_from) == 1 and not held_from & {index[tuple(s.tokens.tolist())] for s in train}


def test_distill_reads_no_more_text_than_its_training_can_pass_over(fx, tmp_path, monkeypatch):
    """Bound by time, distill times a training step first (on a head of its own: the run's random state and the
    trunk are untouched); the teacher stops once the steps the rest of the budget buys would pass over its training
    pieces fewer than `min_passes` times: a machine that trains slowly reads one training piece, a quick one what
    its share of the time allows, and one in between as many as the training it is left with passes over
    `min_passes` times. distill's clock is a counter here (every reading 0.05 s later), so the run is the same on a
    loaded machine."""
    from outrider.plugins.drafters.mtp import distill as module

    _, g, model, _ = module.load_trunk(str(fx.model_path("llama")))
    passes = 2.0
    make_settings = lambda: module.DistillSettings(minutes=0.5, generate_tokens=12, stdlib_chunks=2, draft_vocab=64,
                                                   eval_tokens=0, prompts=("Hello there", "def f(x):"), seq_len=16,
                                                   matrices="F16", fresh=True, min_passes=passes)
    rng, norm = torch.get_rng_state(), model.output_norm.clone()
    assert module.step_seconds(model, g, torch.arange(64), make_settings()) > 0
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model.output_norm, norm)

    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 0.05
            return self.now

    budgets, real_train = [], module.train

    def spy(head, optimizer, samples, step, settings, budget, *args, **kwargs):
        budgets.append(budget)
        return real_train(head, optimizer, samples, step, settings, budget, *args, **kwargs)

    monkeypatch.setattr(module, "train", spy)

    def read(seconds):
        monkeypatch.setattr(module, "step_seconds", lambda *args: seconds)
        monkeypatch.setattr(module, "time", Clock())
        out = tmp_path / f"{seconds}" / "head.mtp.gguf"
        module.distill(str(fx.model_path("llama")), make_settings(), out, echo=lambda line: None)
        data = torch.load(out.with_suffix(".teacher.pt"), weights_only=False)
        return len(data["train"]), {tuple(s.tokens.tolist()) for s in data["held"] + data["train"]}

    (n_slow, slow), (_, quick) = read(1e6), read(1e-6)
    assert (n_slow, len(slow)) == (1, 2) and len(quick) > 20 and slow <= quick  # one piece held out, one trained on
    # held out by whole sources, the training pieces need not grow by one a piece: the count the teacher asked
    # about before each piece, as the split it would stop with gives it
    training, split = [], module.held_out_indices

    def counted(sources, settings):
        held = split(sources, settings)
        training.append(len(sources) - len(held))
        return held

    monkeypatch.setattr(module, "held_out_indices", counted)
    seconds = 1.5
    n, _ = read(seconds)
    steps = budgets[-1] / seconds  # what the training left after the teacher buys
    assert training[-1] == training[-2] == n  # the split it stopped on is the one it trains on
    assert 2 < n < 20 and training[-3] * passes < steps + 0.5 and n * passes >= steps - 0.5, (training, steps)


@pytest.mark.parametrize("n_parts", [1, 3])
@pytest.mark.parametrize("options", [{}, {"act": "silu"}, {"in_norm": True, "out_norm": True, "residual": True,
                                                           "softcap": 5.0}])
def test_trained_projections_run_apart_as_their_stacked_weight_would(n_parts, options):
    """`StackedLinear` (the head's q/k/v and gate/up, a product per part) against one product with the parts'
    weights stacked: the same outputs and the same gradients for every part."""
    from outrider.models.linear import DenseLinear, StackedLinear

    gen = torch.Generator().manual_seed(n_parts)
    k = 8 if options.get("act") else 4  # act halves the input: gate, up
    parts = [torch.randn(n, k, generator=gen, requires_grad=True) for n in (5, 3, 2)[:n_parts]]
    x = torch.randn(6, 2 * k if options.get("act") else k, generator=gen)
    out = sum(p.shape[0] for p in parts)
    kw = {"eps": 1e-6, "act": options.get("act"), "softcap": options.get("softcap", 0.0),
          "in_norm": torch.rand(x.shape[1], generator=gen) + 0.5 if options.get("in_norm") else None,
          "out_norm": torch.rand(out, generator=gen) + 0.5 if options.get("out_norm") else None,
          "residual": torch.randn(6, out, generator=gen) if options.get("residual") else None}
    apart = StackedLinear(*parts)(x, **kw)
    (apart * torch.arange(out)).sum().backward()
    grads = [p.grad.clone() for p in parts]
    for p in parts:
        p.grad = None
    stacked = DenseLinear(torch.cat(parts))(x, **kw)
    (stacked * torch.arange(out)).sum().backward()
    torch.testing.assert_close(apart, stacked)
    for got, p in zip(grads, parts):
        torch.testing.assert_close(got, p.grad)


def test_distill_goes_round_its_prompts_again_while_the_writing_time_lasts(fx):
    """Every prompt answered and time left, the prompts are answered again, up to `generate_rounds` times, every
    later answer sampled (a greedy one would only repeat); at temperature 0 they are answered once."""
    from outrider.io.chat import template_or_raw_ids
    from outrider.plugins.drafters.mtp.distill import DistillSettings, load_trunk, stdlib_texts, training_text

    _, g, model, tokenizer = load_trunk(str(fx.model_path("qwen2")))
    prompts = ("Hello there", "def f(x):", "a b c")

    def corpus(**kw):
        settings = DistillSettings(**{"generate_tokens": 6, "stdlib_chunks": 0, "prompts": prompts, **kw})
        return training_text(model, g, tokenizer, settings, 1e6, random.Random(0), torch.Generator().manual_seed(0))

    rounds, _, sources = corpus(generate_rounds=3)
    ids = [template_or_raw_ids(g, tokenizer, text)[0] for text in prompts]
    which = [next(i for i, p in enumerate(ids) if seq[:len(p)] == p) for seq in rounds]
    assert len(rounds) == 3 * len(prompts) and which == which[:len(prompts)] * 3  # the same order every round
    assert sources == [("prompt", prompts[i]) for i in which]  # each answer's source: the prompt it answers
    answers = [seq[len(ids[i]):] for i, seq in zip(which, rounds)]
    for j in range(0, len(prompts), 2):  # the first round's greedy rows
        assert answers[j] == fx.plain_greedy("qwen2", ids[which[j]], 6)[:len(answers[j])]
    assert any(answers[r * len(prompts) + j] != answers[j] for r in (1, 2) for j in range(0, len(prompts), 2))
    assert len(corpus(generate_rounds=3, temperature=0.0)[0]) == len(prompts)
    library, _, sources = corpus(generate_rounds=1, stdlib_chunks=2, seq_len=16)
    rng = random.Random(0)  # the draws training_text makes: the prompts' order, then the passages
    rng.shuffle(list(prompts))
    texts = [tokenizer.encode(text) for text in stdlib_texts(2, rng)]
    labels = sources[len(prompts):]
    assert len(labels) == len(library) - len(prompts) > 2 and set(labels) == {
        ("library passage", 0), ("library passage", 1)}
    for piece, (_, passage) in zip(library[len(prompts):], labels):  # each piece from the passage it is labelled with
        ids = texts[passage]
        assert any(ids[j:j + len(piece)] == piece for j in range(len(ids))), passage


def test_the_held_out_pieces_come_from_sources_training_never_sees():
    """`held_out_indices` holds out whole sources (all answers to a prompt): no source on both sides, at most
    `held_out_count` pieces, a source too large passed over for those after it, never every source, the same split
    for the same seed; where no whole source fits, or there is one, that many pieces of the smallest."""
    from outrider.plugins.drafters.mtp.distill import DistillSettings, held_out_count, held_out_indices

    sources = [f"prompt {i % 7}" for i in range(40)] + [f"passage {i // 3}" for i in range(30)]  # 5-6 and 3 pieces
    splits = set()
    for seed in range(6):
        settings = DistillSettings(seed=seed, held_out=0.1, max_held_out=16)
        held = held_out_indices(sources, settings)
        assert held == held_out_indices(sources, settings)
        splits.add(tuple(held))
        held_from = {sources[i] for i in held}
        train_from = {source for i, source in enumerate(sources) if i not in held}
        assert not held_from & train_from and train_from
        assert 1 <= len(held) <= held_out_count(len(sources), settings) == 7
        assert [i for i, source in enumerate(sources) if source in held_from] == held  # whole sources
    assert len(splits) > 1  # the draw follows the seed
    everything = DistillSettings(held_out=1.0)
    assert len({["a", "a", "b", "b"][i] for i in held_out_indices(["a", "a", "b", "b"], everything)}) == 1
    big = ["a"] * 5 + ["b"] * 3 + ["c"] * 4  # every source larger than the one piece to hold out: one of the smallest
    assert held_out_indices(big, DistillSettings(held_out=0.1)) == [5]
    for seed in range(6):  # two pieces to hold: "c" never fits, "a" and "b" always do, whichever is drawn first
        assert held_out_indices(["a", "b"] + ["c"] * 8, DistillSettings(seed=seed, held_out=0.2)) == [0, 1]
    tie = held_out_indices(["a", "a", "b", "b"], DistillSettings(held_out=0.1))
    assert tie in ([0], [2]) and tie == held_out_indices(["a", "a", "b", "b"], DistillSettings(held_out=0.1))
    one = held_out_indices(["one answer"] * 10, DistillSettings(held_out=0.2))
    assert len(one) == 2 and held_out_indices(["one answer"], DistillSettings()) == [0]


def test_distill_reduces_the_held_out_kl(distilled):
    assert distilled.steps == 15
    assert distilled.heldout_kl_end < 0.8 * distilled.heldout_kl_start, distilled


def test_a_distilled_head_drafts_what_the_spec_equations_give(fx, distilled):
    """The written sidecar (q/k rows permuted back to llama.cpp's order, float16 matrices (exact; the default
    Q4_0 is what a user drafts with), the reduced head) read by the drafter gives the oracle's distributions."""
    target = fx.target("llama")
    drafter = MTPDrafter(model=str(distilled.sidecar), sample=True)
    drafter.setup(target)
    tokens = PROMPT + [9]
    state = drafter.begin(list(PROMPT), SamplingParams(temperature=1.0, seed=4), DraftControls())
    hidden = _target_hidden(target, tokens)
    drafter.observe(state, hidden[: len(PROMPT)], 0, None)
    draft = drafter.propose(state, list(tokens), 3)
    want = torch.softmax(Oracle("llama", fx.model_path("llama"), distilled.sidecar).draft_logits(
        tokens, hidden, draft.tokens[:-1]), -1)
    torch.testing.assert_close(draft.probs, want, atol=2e-5, rtol=1e-4)


def test_a_gemma4_target_is_refused_in_one_line(fx):
    """The mtp drafter runs nextn blocks of the trunk's own kind; Gemma 4 has its assistant instead."""
    from outrider.errors import ConfigError

    with pytest.raises(ConfigError, match="gemma-assistant"):
        MTPDrafter().setup(fx.target("gemma4"))


def _perturbed_head(target, seed: int):
    """(a TrainableHead of `target` moved off the trunk's last layer by noise, its draft vocabulary: every third id),
    a head as training leaves one, for tests of how it is written and read."""
    from outrider.plugins.drafters.mtp.head import TrainableHead

    vocab_ids = torch.arange(0, target.model.config.vocab_size, 3)
    head = TrainableHead(target.model, target.gguf, vocab_ids)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.w.values():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return head, vocab_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3-period-4-softcap", "qwen2", "qwen3"])
def test_the_training_head_and_the_drafting_head_are_one_forward(fx, tmp_path, arch):
    """distill trains `TrainableHead` (plain torch, gradients) and the drafter runs `MTPHead` (the backend's
    kernels, a KV cache): on the same weights (the trained head rounded to the sidecar's float16, then
    written as a sidecar), positions and an empty cache, both give the same logits and hidden rows. The
    third case has 7 layers listed local-local-local-global-..., so the head's block 7 is global by the
    file's period (not by a period of 6), and a final logit softcap both must apply. Chains too: the training
    head's depths 2 and 3 (all rows at once, `chain_mask`) are the drafter's second and third drafts."""
    from outrider.plugins.drafters.mtp.sidecar import write_sidecar as write_trained
    from outrider.plugins.drafters.mtp.head import MTPHead, TrainableHead, shifted
    from outrider.testing.fixtures import cpu_target
    from outrider.testing.tiny_models import write_tiny_gemma3

    if arch == "gemma3-period-4-softcap":
        target = cpu_target(write_tiny_gemma3(tmp_path / "p4.gguf", n_layers=7, window=4, final_softcap=3.0,
                                              pattern=[True, True, True, False, True, True, True]))
        arch = "gemma3"
        from outrider.models.gemma3 import local_layers

        assert local_layers(target.gguf, 8)[7] is False  # block 7 = 3 mod 4: global, by hand (not 7 % 6 < 5)
        assert target.model.logit_softcap == 3.0  # both heads read it from here: it must be the file's
    else:
        target = fx.target(arch)
    model, g = target.model, target.gguf
    head, vocab_ids = _perturbed_head(target, seed=5)  # a reduced draft vocabulary, as distill keeps
    with torch.no_grad():
        for p in head.w.values():
            if p.dim() == 2:
                p.copy_(p.half().float())
    path = tmp_path / f"{arch}.mtp.gguf"
    write_trained(path, head, g, vocab_ids, matrices="F16")
    again = TrainableHead.from_sidecar(model, g, GGUFFile(path))  # what drafter.learn trains on: the same head
    assert sorted(again.w) == sorted(head.w)
    for name, param in head.w.items():
        torch.testing.assert_close(again.w[name], param.detach().half().float() if param.dim() == 2 else param.detach())
    tokens = [5, 17, 42, 8, 99, 3, 64, 7, 21, 11]
    hidden = _target_hidden(target, tokens).float()
    with native_activations("float32"), torch.no_grad():
        want_logits, want_h = head(torch.tensor(tokens), shifted(hidden))
        drafting = MTPHead(GGUFFile(path), model.config.n_layers, target, 64)
        cache = drafting.new_cache()
        for end in range(1, len(tokens) + 1):  # row by row through the cache, as the drafter feeds it
            logits, h = drafting.forward(torch.tensor(tokens[end - 1:end]), shifted(hidden)[end - 1:end], end - 1,
                                         cache)
            torch.testing.assert_close(h[-1].float(), want_h[end - 1], atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(logits, want_logits[end - 1], atol=2e-4, rtol=1e-4)
            if model.logit_softcap:  # applied, not only read: softcapped logits lie within +-cap (by hand)
                assert logits.abs().max() < model.logit_softcap
        # deeper drafts, trained all at once, against the drafter's chain: seed row n from the target's hidden,
        # then the drafted tokens (here the text's own: a chain whose drafts were right) on the head's own h'
        chained = head.chain(torch.tensor(tokens), shifted(hidden), 3)
        for n in range(len(tokens) - 1):
            cache.truncate(n)
            logits, h = drafting.forward(torch.tensor(tokens[n:n + 1]), shifted(hidden)[n:n + 1], n, cache)
            for m in range(1, min(3, len(tokens) - n)):
                logits, h = drafting.forward(torch.tensor(tokens[n + m:n + m + 1]), h[-1:].float(), n + m, cache)
                torch.testing.assert_close(h[-1].float(), chained[m][1][n + m], atol=3e-4, rtol=1e-4)
                torch.testing.assert_close(logits, chained[m][0][n + m], atol=3e-4, rtol=1e-4)
    if model.logit_softcap:
        assert want_logits.abs().max() < model.logit_softcap


def test_a_bfloat16_step_follows_the_float32_step(fx):
    """One training step of the tiny llama's head under `precision="bf16"` (autocast, forced on any CPU) and
    one under fp32, from the same parameters and batch: the bf16 loss is the fp32 one within bfloat16's
    rounding (2^-8 relative per product, a few percent over the block) and not equal to it (the autocast ran), the
    parameters stay float32, and the update points the same way (cosine > 0.95 over every trained weight)."""
    from outrider.plugins.drafters.mtp.head import TrainableHead, shifted

    target = fx.target("llama")
    model, g = target.model, target.gguf
    vocab_ids = torch.arange(0, model.config.vocab_size, 3)
    tokens = torch.tensor([5, 17, 42, 8, 99, 3, 64, 7, 21, 11, 5, 17])
    hidden = _target_hidden(target, tokens.tolist()).float().clone()  # out of inference mode, as distill's are
    want = torch.softmax(torch.randn(len(tokens), len(vocab_ids), generator=torch.Generator().manual_seed(3)), -1)
    results = {}
    for precision in ("fp32", "bf16"):
        head = TrainableHead(model, g, vocab_ids)  # from the trunk's weights: the same start both times
        before = {n: p.detach().clone() for n, p in head.w.items()}
        optimizer = torch.optim.SGD(head.trained_parameters(), lr=1e-2)

        def loss_and_value():
            loss = head.loss(tokens, shifted(hidden), hidden, want, feature_weight=0.1)[0]
            return loss, loss.detach()

        loss, = head.train_step(optimizer, loss_and_value, precision)
        assert all(p.dtype == torch.float32 for p in head.w.values())
        results[precision] = float(loss), torch.cat([(head.w[n].detach() - before[n]).flatten() for n in before])
    (loss32, step32), (loss16, step16) = results["fp32"], results["bf16"]
    assert loss16 != loss32 and abs(loss16 - loss32) <= 0.03 * abs(loss32), (loss16, loss32)
    cosine = float(torch.nn.functional.cosine_similarity(step16, step32, dim=0))
    assert cosine > 0.95, cosine


def test_an_interrupted_distill_resumes_to_the_uninterrupted_head(fx, tmp_path):
    """Ctrl-C during training saves a checkpoint; the same command then finishes the run, and its head is the
    head of a run that was never stopped (same seed, same steps): the corpus and the target's distributions
    come back from their files, the sample order and the input noise are functions of the step, AdamW's state is
    saved."""
    from outrider.plugins.drafters.mtp.distill import DistillSettings, distill

    settings = lambda: DistillSettings(steps=8, generate_tokens=12, stdlib_chunks=1, draft_vocab=64, eval_tokens=0,
                                       lr=3e-3, prompts=("Hello there", "def f(x):"), seq_len=32, matrices="F16",
                                       noise=0.2, weight_decay=0.01)

    def interrupt(step):
        if step == 3:
            raise KeyboardInterrupt

    whole = tmp_path / "whole" / "head.mtp.gguf"
    resumed = tmp_path / "resumed" / "head.mtp.gguf"
    distill(str(fx.model_path("llama")), settings(), whole, echo=lambda line: None)
    with pytest.raises(KeyboardInterrupt):
        distill(str(fx.model_path("llama")), settings(), resumed, echo=lambda line: None, on_step=interrupt)
    assert torch.load(resumed.with_suffix(".distill.pt"), weights_only=False)["step"] == 3
    lines = []
    stale = resumed.with_suffix(".distilled.gguf")  # what `drafter.learn` kept of an earlier distill's head
    stale.write_bytes(b"an earlier head")
    report = distill(str(fx.model_path("llama")), settings(), resumed, echo=lines.append)
    assert report.steps == 8 and any("resuming training at step 3" in line for line in lines), lines
    assert not stale.exists()  # the learner's anchor and its save read the new head, not that one
    a, b = GGUFFile(whole), GGUFFile(resumed)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        if name.endswith("draft_vocab"):
            assert bytes(a.raw(name)) == bytes(b.raw(name))
        else:
            torch.testing.assert_close(b.load(name), a.load(name), atol=1e-5, rtol=1e-4)


def test_a_resumed_distill_takes_this_runs_weight_decay(fx, tmp_path, monkeypatch):
    """AdamW's saved state carries the stopped run's param groups, its weight decay among them; the run that goes
    on trains with the decay it was given."""
    from outrider.plugins.drafters.mtp import distill as module

    seen, real_train = [], module.train

    def spy(head, optimizer, *args, **kwargs):
        seen.append([group["weight_decay"] for group in optimizer.param_groups])
        return real_train(head, optimizer, *args, **kwargs)

    def interrupt(step):
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "train", spy)
    settings = lambda decay: module.DistillSettings(steps=4, generate_tokens=12, stdlib_chunks=1, draft_vocab=64,
                                                    eval_tokens=0, prompts=("Hello there",), seq_len=32,
                                                    matrices="F16", weight_decay=decay)
    out = tmp_path / "head.mtp.gguf"
    with pytest.raises(KeyboardInterrupt):
        module.distill(str(fx.model_path("llama")), settings(0.5), out, echo=lambda line: None, on_step=interrupt)
    module.distill(str(fx.model_path("llama")), settings(0.0), out, echo=lambda line: None)
    assert seen == [[0.5], [0.0]]


def test_a_stopped_distill_goes_on_with_the_rest_of_its_time(fx, tmp_path, monkeypatch):
    """Bound by time (no --steps), a run stopped during training and started again trains for what was left of
    its training budget, the learning rate going on down the same curve (not starting its warm-up over); a finished
    run started again trains further for a new budget. distill's clock is a counter here
    (every reading 0.05 s later), so the run takes the same steps on a loaded machine."""
    from outrider.plugins.drafters.mtp import distill as module

    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 0.05
            return self.now

    settings = lambda: module.DistillSettings(minutes=0.1, generate_tokens=12, stdlib_chunks=1, draft_vocab=64,
                                              eval_tokens=0, prompts=("Hello there", "def f(x):"), seq_len=32,
                                              matrices="F16")
    done = []
    monkeypatch.setattr(module, "learning_rate", lambda peak, at: (done.append(min(at, 1.0)), peak)[1])
    monkeypatch.setattr(module, "time", Clock())
    out = tmp_path / "head.mtp.gguf"

    def interrupt(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        module.distill(str(fx.model_path("llama")), settings(), out, echo=lambda line: None, on_step=interrupt)
    stopped = torch.load(out.with_suffix(".distill.pt"), weights_only=False)
    assert 0 < stopped["seconds"] < stopped["budget"] and stopped["step"] == 3
    done.clear()
    lines = []
    module.distill(str(fx.model_path("llama")), settings(), out, echo=lines.append)
    finished = torch.load(out.with_suffix(".distill.pt"), weights_only=False)
    assert finished["budget"] == stopped["budget"] and finished["seconds"] >= stopped["budget"]
    assert any("training minutes left" in line for line in lines), lines
    assert done[0] >= stopped["seconds"] / stopped["budget"] > 0 and done[-1] <= 1.0
    done.clear()
    module.distill(str(fx.model_path("llama")), settings(), out, echo=lambda line: None)
    again = torch.load(out.with_suffix(".distill.pt"), weights_only=False)
    assert again["step"] > finished["step"] and done[0] < 0.05  # a new budget, the curve from its start
    out.unlink()  # as if stopped after training, before the sidecar was written: the run again only writes it
    done.clear()
    lines.clear()
    module.distill(str(fx.model_path("llama")), settings(), out, echo=lines.append)
    assert out.is_file() and not done and any("writing the sidecar" in line for line in lines), lines
    assert torch.load(out.with_suffix(".distill.pt"), weights_only=False)["step"] == again["step"]


def test_draft_chains_see_the_keys_the_drafter_caches():
    """`chain_mask` by hand: 5 rows, depth 3, a window of 3. Row p at depth 3 is the third draft of the chain
    seeded at row p - 2: depth 1's keys up to p - 2 less than 3 rows back, depth 2's at p - 1, depth 3's at p."""
    from outrider.models.layers import chain_mask

    want = torch.tensor([
        # depth 1 keys 0..4     depth 2 keys 0..4    depth 3 keys 0..4
        [0, 0, 0, 0, 0] + [0, 0, 0, 0, 0] + [1, 0, 0, 0, 0],  # row 0: no chain this deep; its own key only
        [0, 0, 0, 0, 0] + [1, 0, 0, 0, 0] + [0, 1, 0, 0, 0],  # row 1: no depth-1 seed at -1
        [1, 0, 0, 0, 0] + [0, 1, 0, 0, 0] + [0, 0, 1, 0, 0],  # row 2: seeded at 0
        [0, 1, 0, 0, 0] + [0, 0, 1, 0, 0] + [0, 0, 0, 1, 0],  # row 3: seeded at 1; key 0 is 3 back: outside
        [0, 0, 1, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1],  # row 4: seeded at 2
    ], dtype=torch.bool)
    assert torch.equal(chain_mask(5, 3, 3, "cpu"), want)
    assert torch.equal(chain_mask(4, 1, None, "cpu"), torch.ones(4, 4, dtype=torch.bool).tril())  # depth 1: causal


@pytest.mark.parametrize("bad, message", [(dict(depth=0), "--depth 1 or more"),
                                          (dict(precision="fp8"), "auto, bf16 or fp32"),
                                          (dict(noise=-0.1), "values >= 0"), (dict(weight_decay=-1.0), "values >= 0")])
def test_bad_distill_settings_are_refused_in_one_line_before_the_target_loads(tmp_path, bad, message):
    from outrider.errors import ConfigError
    from outrider.plugins.drafters.mtp.distill import DistillSettings, distill

    with pytest.raises(ConfigError, match=message):
        distill(str(tmp_path / "missing.gguf"), DistillSettings(**bad), echo=lambda line: None)


@pytest.mark.parametrize("arch", ["llama", "gemma3-softcap"])
def test_the_teacher_gives_the_targets_distribution_within_the_draft_vocabulary(fx, tmp_path, arch):
    """distill's teacher reads only the draft vocabulary's output rows: its top-k is the target's own forward's
    (plain decoding logits) restricted to those tokens, renormalized there, then cut to k and renormalized. On the
    dense float32 weights, so that the comparison sees the restriction and no kernel's rounding."""
    from outrider.plugins.backends.cpu import CPUBackend
    from outrider.plugins.drafters.mtp.distill import teacher
    from outrider.testing.tiny_models import write_tiny_gemma3

    path = write_tiny_gemma3(tmp_path / "softcap.gguf", final_softcap=3.0) if arch == "gemma3-softcap" \
        else fx.model_path(arch)
    model = CPUBackend(weights="dense").load_model(GGUFFile(path))
    vocab_ids = torch.arange(1, model.config.vocab_size, 2)
    tokens = [5, 17, 42, 8, 99, 3, 64, 7, 21, 11]
    s = teacher(model, tokens, model.output.rows(vocab_ids).float(), top_k=8)
    logits = model.forward(torch.tensor(tokens), 0, model.new_cache(len(tokens)))
    top = torch.softmax(logits[:, vocab_ids].double(), -1).topk(8, dim=-1)
    dense = lambda ids, p: torch.zeros(len(tokens), len(vocab_ids), dtype=torch.float64).scatter(1, ids, p.double())
    # as distributions: near-equal probabilities may come in either order
    torch.testing.assert_close(dense(s.top_ids, s.top_p), dense(top.indices, top.values / top.values.sum(-1, True)),
                               atol=1e-5, rtol=0)


def test_the_learning_rate_warms_up_then_decays():
    """By hand: a linear rise over the first 5% of the run from 2% of the peak (a first step that moves the head a
    little), the peak there and never above it, cosine decay to a tenth of it at the end, halfway down (0.55)
    halfway through the decay."""
    from outrider.plugins.drafters.mtp.distill import learning_rate

    assert learning_rate(1.0, 0.0) == pytest.approx(0.02)
    assert learning_rate(1.0, 0.025) == pytest.approx(0.51)
    assert learning_rate(1.0, 0.05) == pytest.approx(1.0)
    assert learning_rate(1.0, 0.525) == pytest.approx(0.55)
    assert learning_rate(1.0, 1.0) == pytest.approx(0.1) and learning_rate(1.0, 2.0) == pytest.approx(0.1)
    rates = [learning_rate(1.0, i / 10_000) for i in range(10_001)]
    assert max(rates) <= 1.0
    assert rates[:500] == sorted(rates[:500]) and rates[500:] == sorted(rates[500:], reverse=True)


def test_noise_perturbs_what_the_head_reads_not_what_it_is_taught():
    """EAGLE's input noise: the hidden states the head reads (h_{p-1}) move by at most noise x their RMS, and by
    a good part of it somewhere; the feature term's target (h_p) and the target distribution stay exact; the same
    generator seed gives the same perturbation."""
    from outrider.plugins.drafters.mtp.distill import Sample, sample_loss

    class Recorder:
        def loss(self, tokens, h_prev, hidden, want_p, want_ids, feature_weight, depth):
            self.seen = (h_prev, hidden, want_p)
            return torch.zeros(()), torch.zeros(()), torch.zeros(())

    hidden = (3 * torch.randn(40, 16, generator=torch.Generator().manual_seed(0))).half()
    s = Sample(torch.arange(40), hidden, torch.zeros(40, 4, dtype=torch.long), torch.full((40, 4), 0.25))
    clean, rms = hidden.float(), float(hidden.float().pow(2).mean().sqrt())
    seen = []
    for seed in (1, 1):
        r = Recorder()
        sample_loss(r, s, noise=0.1, generator=torch.Generator().manual_seed(seed))
        seen.append(r.seen)
    h_prev, taught, want = seen[0]
    moved = (h_prev[1:] - clean[:-1]).abs()
    assert torch.equal(taught, clean) and torch.equal(want, s.top_p)
    assert float(moved.max()) <= 0.1 * rms * (1 + 1e-6) and float(moved.max()) > 0.09 * rms
    assert torch.equal(h_prev[0], torch.zeros(16)) and torch.equal(seen[1][0], h_prev)
    r = Recorder()
    sample_loss(r, s)
    assert torch.equal(r.seen[0][1:], clean[:-1])


def test_learning_moves_the_head_toward_the_target_and_is_saved(fx, tmp_path):
    """`drafter.learn` on one text, round after round: the head's distribution (the oracle's equations on the
    saved file) moves toward the target's own (its forward, renormalized over the draft vocabulary) on that
    text, and the learned head replaces the sidecar at save, the distilled one kept beside it."""
    target = fx.target("llama")
    vocab = target.model.config.vocab_size
    ids = list(range(0, vocab, 2))
    path = write_sidecar(tmp_path / "head.mtp.gguf", "llama", fx.model_path("llama"), seed=3, reduced=True, ids=ids)
    original = path.read_bytes()
    tokens = [5, 17, 42, 8, 99, 3, 64, 7, 21, 11, 30, 2, 77, 15, 60, 4, 9, 33, 12, 50]
    hidden = _target_hidden(target, tokens)
    logp = torch.log_softmax(target.model.forward(torch.tensor(tokens), 0, target.model.new_cache(32))[:, ids], -1)

    def kl() -> float:  # KL(target || head) per row, over the draft vocabulary, from the file as it stands
        shifted = torch.cat([torch.zeros(1, hidden.shape[1]), hidden[:-1]])
        logq = torch.log_softmax(Oracle("llama", fx.model_path("llama"), path).rows(tokens, shifted)[0][:, ids], -1)
        return float((logp.exp() * (logp - logq)).sum(-1).mean())

    before = kl()
    drafter = MTPDrafter(model=str(path), learn=True, learn_share=1.0, learn_rows=len(tokens), learn_refresh=5,
                         learn_lr=3e-3)
    drafter.setup(target)
    for _ in range(30):
        state = drafter.begin(tokens[:-1], SamplingParams(), DraftControls())
        drafter.observe(state, hidden[:-1], 0, None)
        drafter.propose(state, list(tokens), 1)
        drafter.end(state)
    assert drafter.learner.steps == 30 and drafter.learner.refreshes == 6
    drafter.learner.save()
    after = kl()
    assert after < 0.5 * before, (before, after)
    assert path.with_suffix(".distilled.gguf").read_bytes() == original
    MTPDrafter(model=str(path)).setup(target)  # the learned head drafts as any sidecar does


def test_learning_time_is_a_share_of_the_time_in_requests(monkeypatch):
    """`learn_share` bounds training by the seconds spent in requests (begin to last round), by hand: idle
    time between requests banks nothing."""
    from outrider.plugins.drafters.mtp import learn

    clock = [0.0]
    monkeypatch.setattr(learn.time, "perf_counter", lambda: clock[0])
    share = learn.TimeShare(0.5)
    share.begin()
    clock[0] = 10.0
    share.charge(4.0)
    assert share.allows()  # 4 s of 10 in requests: under half
    share.charge(2.0)
    assert not share.allows()
    clock[0] = 100.0  # 90 s idle, then the next request
    share.begin()
    clock[0] = 101.0
    assert not share.allows()  # 6 s of 11 in requests
    clock[0] = 113.0
    assert share.allows()  # 6 s of 23
    assert learn.TimeShare(1.0).allows()  # no limit
    busy = learn.TimeShare(0.0)  # a server's share while idle time keeps up: 10 s of requests at 0
    busy.begin()
    clock[0] = 123.0
    assert not busy.allows()
    busy.begin(0.5)  # a request came before the idle work was done: the share again, from then on
    clock[0] = 124.0
    busy.charge(0.6)
    assert not busy.allows()  # 0.6 s of side work against half of 1 s: the 10 s at share 0 lend nothing
    clock[0] = 125.0
    assert busy.allows()  # half of 2 s


# ------------------------------------------------------------------------------------------ learning, rebuilt


def test_the_q8_0_quantizer_is_gguf_pys_bit_for_bit():
    """The learner's torch quantizer against gguf-py's (the reference, bit-exact to ggml's C): random weights of
    several scales, a block of zeros (scale 0), and weights lying exactly halfway between two codes (ggml rounds
    half away from zero; torch.round would round half to even)."""
    from outrider.plugins.drafters.mtp.sidecar import quantize_q8_0

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 96, generator=gen) * torch.logspace(-4, 2, 24).unsqueeze(1)
    w[3, 32:64] = 0.0
    w[5, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 3.5] + [0.25] * 26)  # d = 1: x.5 lands on a tie
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    got = quantize_q8_0(w)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert got[5, 2:8].view(np.int8).tolist() == [127, 1, -1, 2, -3, 4]  # by hand: half away from zero


@pytest.mark.parametrize("arch,matrices", [("llama", "Q8_0"), ("qwen2", "Q8_0"), ("qwen2", "Q4_0")])
def test_the_head_rebuilt_in_memory_is_the_head_its_file_holds(fx, tmp_path, arch, matrices):
    """`drafter.learn` swaps in the head it trains without writing it: the tensors held in memory are, byte for
    byte, those `write_sidecar` writes and `GGUFFile` reads back (llama's permuted q/k rows, Qwen2's three
    biases), with the same metadata, and the drafting head built from either gives the same rows; in the form a
    learner holds (Q8_0) and the one distill writes (Q4_0)."""
    from outrider.plugins.drafters.mtp.head import MTPHead, shifted
    from outrider.plugins.drafters.mtp.sidecar import head_in_memory, write_sidecar as write_trained

    target = fx.target(arch)
    model, g = target.model, target.gguf
    head, vocab_ids = _perturbed_head(target, seed=7)
    path = tmp_path / "head.mtp.gguf"
    write_trained(path, head, g, vocab_ids, matrices)
    on_disk, in_memory = GGUFFile(path), head_in_memory(head, g, vocab_ids, "learning", matrices)
    assert sorted(in_memory.tensors) == sorted(on_disk.tensors)
    for name, info in on_disk.tensors.items():
        held = in_memory.tensors[name]
        assert (held.shape, held.type) == (info.shape, info.type), name
        assert np.array_equal(in_memory.raw(name), on_disk.raw(name)), name
    read = {k: v for k, v in on_disk.metadata.items() if k.startswith(on_disk.architecture + ".")}
    assert in_memory.metadata == {"general.architecture": on_disk.architecture, **read}
    tokens = [5, 17, 42, 8, 99, 3, 64, 7]
    hidden = shifted(_target_hidden(target, tokens).float())
    with native_activations("float32"), torch.no_grad():
        heads = [MTPHead(source, model.config.n_layers, target, 16) for source in (on_disk, in_memory)]
        rows = [head.forward(torch.tensor(tokens), hidden, 0, head.new_cache()) for head in heads]
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])


def test_a_q4_0_head_holds_the_trained_weights_to_a_step_and_learns_in_q8_0(fx, tmp_path):
    """The default sidecar holds the head's matrices as Q4_0: read back, every weight is within one Q4_0 step
    of the trained one, a block's largest magnitude m / 8 (ggml's d = m / -8 rounds to half a step, but codes
    stop at 15: a weight near -m lands on 7 steps); its float16 scale adds under 0.5%. Vectors stay float32.
    `drafter.learn` rebuilds and saves it in Q8_0, whose steps its changes are not lost in."""
    from gguf import GGMLQuantizationType as Q

    from outrider.plugins.drafters.mtp.head import TrainableHead
    from outrider.plugins.drafters.mtp.sidecar import matrices_of, write_sidecar as write_trained

    target = fx.target("qwen2")
    model, g = target.model, target.gguf
    head, vocab_ids = _perturbed_head(target, seed=9)
    path = tmp_path / "head.mtp.gguf"
    write_trained(path, head, g, vocab_ids)
    on_disk = GGUFFile(path)
    kinds = {info.type for info in on_disk.tensors.values() if len(info.shape) == 2}
    assert kinds == {Q.Q4_0} and matrices_of(on_disk, model.config.n_layers) == "Q4_0"
    again = TrainableHead.from_sidecar(model, g, on_disk)
    for name, param in head.w.items():
        want = param.detach()
        if want.dim() == 1:
            assert torch.equal(again.w[name], want), name
            continue
        blocks = want.reshape(-1, 32)
        bound = blocks.abs().amax(-1, keepdim=True) * (1 / 8 + 0.005)
        assert ((again.w[name].detach().reshape(-1, 32) - blocks).abs() <= bound).all(), name
    drafter = MTPDrafter(model=str(path), learn=True, learn_share=1.0)
    drafter.setup(target)
    learner = drafter.learner
    assert {t.type for t in learner.drafting_tensors().tensors.values() if len(t.shape) == 2} == {Q.Q8_0}
    learner.unsaved = True
    learner.save()
    assert matrices_of(GGUFFile(path), model.config.n_layers) == "Q8_0"


def _learning_runner(fx, tmp_path, **options):
    target = fx.target("llama")
    tmp_path.mkdir(exist_ok=True)
    path = write_sidecar(tmp_path / "head.mtp.gguf", "llama", fx.model_path("llama"), seed=3, reduced=True,
                         ids=list(range(0, target.model.config.vocab_size, 2)))
    drafter = MTPDrafter(model=str(path), learn=True, learn_rows=8, learn_refresh=100, learn_lr=3e-2, **options)
    drafter.setup(target)
    return drafter, Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=2), context=64)


def test_idle_learning_trains_the_last_requests_rows_and_then_requests_do_not(fx, tmp_path, monkeypatch):
    """With the default share, a generation trains as it goes until the host first offers idle time; then
    `Runner.idle` trains on the request's rows no step reached, a window a call, the windows ending a quarter of
    `rows` (2) apart and the last at the last certain row, as a request's steps would; then, in the last unit,
    rebuilds the drafting head (the request's KV cache kept as it was, not refilled) and says no work is left. From then on
    requests train nothing and leave their rows to the idle time after them. Greedy output stays plain
    decoding's throughout."""
    drafter, runner = _learning_runner(fx, tmp_path)
    learner = drafter.learner
    monkeypatch.setattr(learner.clock, "allows", lambda: True)  # the 0.2 share, whatever this machine's timings
    want = fx.plain_greedy("llama", PROMPT, 12)
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == want
    in_request = learner.steps
    assert in_request > 0  # no idle time offered yet: it learned during the request
    ends = []
    train = learner._train
    monkeypatch.setattr(learner, "_train", lambda tokens, hidden, certain: (ends.append(certain),
                                                                            train(tokens, hidden, certain)))
    finished = drafter._last_finished  # the request's state, kept for the idle work
    first, observed = learner.trained_to, finished.observed
    cache, head = finished.caches[0], drafter.heads[0]
    rows = cache.length
    units = 0
    while runner.idle():
        units += 1
    assert ends == list(range(first + 2, observed, 2)) + [observed], (first, observed, ends)
    assert units == len(ends) and learner.steps == in_request + len(ends)  # the last unit rebuilds, says done
    assert drafter.heads[0] is not head and learner.refreshes == 1
    assert finished.caches[0] is cache and cache.length == rows and drafter._last_finished is finished
    assert not runner.idle() and learner.refreshes == 1  # nothing new: no second rebuild
    monkeypatch.undo()  # the clock's own rule again
    steps = learner.steps
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == want
    assert learner.clock.share == 0.0 and learner.steps == steps  # requests train nothing now
    while runner.idle():
        pass
    assert learner.steps - steps == math.ceil(drafter._last_finished.observed / 2) and learner.refreshes == 2
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == want


def test_a_server_learns_between_requests_and_a_busy_one_in_them_again(fx, tmp_path):
    """Idle work asked for before any request (a server's worker, at its start) finds none and sets requests'
    share to 0; a request whose predecessor's idle work was cut short by it trains at the default share again;
    an explicit share stays as given, 0 included."""
    drafter, runner = _learning_runner(fx, tmp_path)
    learner = drafter.learner
    assert not runner.idle() and learner.steps == 0 and learner.refreshes == 0
    want = fx.plain_greedy("llama", PROMPT, 12)
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == want
    assert learner.clock.share == 0.0 and learner.steps == 0  # share 0 allows nothing, whatever the timings
    assert runner.idle()  # one unit, then the next request comes
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == want
    assert learner.clock.share == learner.DEFAULT_SHARE
    while runner.idle():
        pass
    list(runner.generate(list(PROMPT), 1, SamplingParams()))
    assert learner.clock.share == 0.0
    fixed, runner = _learning_runner(fx, tmp_path / "fixed", learn_share=0.0)
    assert not runner.idle() and fixed.learner.clock.share == 0.0
    assert not fixed.learner.clock.allows()


def test_idle_learning_reads_the_rows_of_requests_another_member_drafted(fx, tmp_path):
    """In a chain whose first member drafts every round the MTP member never proposes; the rows the target
    verified are still the MTP head's to learn from between requests: every certain row is trained on, and the
    output stays plain decoding's."""
    from outrider.spec.chain import DrafterChain
    from outrider.spec.drafter import Draft, DrafterBase

    class AlwaysOne(DrafterBase):  # drafts token 1 every round, as a lookup member with a match each round
        def propose(self, state, tokens, k):
            return Draft(tokens=[1])

    mtp, _ = _learning_runner(fx, tmp_path)
    chain = DrafterChain([AlwaysOne(), mtp], ["always", "mtp"])
    runner = Runner(fx.target("llama"), chain, GreedyAcceptor(), DrafterTraits.of(chain, draft_max=2), context=64)
    proposed = []
    propose = mtp.propose
    mtp.propose = lambda state, tokens, k: (proposed.append(len(tokens)), propose(state, tokens, k))[1]
    assert not runner.idle()  # a server's worker before its first request: requests train nothing from here on
    assert list(runner.generate(list(PROMPT), 12, SamplingParams())) == fx.plain_greedy("llama", PROMPT, 12)
    assert proposed == [] and mtp.learner.steps == 0  # the first member drafted every round
    observed = mtp._last_finished.observed  # the request's state, kept for the idle work
    assert observed == len(runner.last_tokens) - 1  # every row but the last token's, which no one verified
    while runner.idle():
        pass
    assert mtp.learner.trained_to == observed and mtp.learner.steps == math.ceil(observed / 2)


def test_the_anchor_pulls_the_learned_weights_toward_the_distilled_head(fx, tmp_path):
    """`learn_anchor` moves the weights back toward the head distill wrote after every step: all the way at 1 (a
    step then leaves the distilled weights exactly), none at 0 (a step leaves the weights it made). Once a learned
    head has replaced the sidecar, the distilled one is read from the copy kept beside it, not from the learned
    head the run starts from. A pull outside [0, 1] is refused in one line."""
    from outrider.errors import ConfigError
    from outrider.plugins.drafters.mtp.head import TrainableHead

    drafter, runner = _learning_runner(fx, tmp_path / "a")
    source = drafter.learner.source
    distilled = [p.detach().clone() for p in drafter.learner.trained]
    list(runner.generate(list(PROMPT), 12, SamplingParams()))
    while runner.idle():
        pass
    drafter.learner.save()  # the learned head over the sidecar, the distilled one beside it
    learned = TrainableHead.from_sidecar(drafter.target.model, drafter.target.gguf, GGUFFile(source))
    assert any(not torch.equal(a, b) for a, b in zip(distilled, learned.trained_parameters()))
    for pull in (1.0, 0.0):
        again = MTPDrafter(model=str(source), learn=True, learn_rows=8, learn_refresh=100, learn_lr=3e-2,
                           learn_anchor=pull)
        again.setup(fx.target("llama"))
        runner = Runner(fx.target("llama"), again, GreedyAcceptor(), DrafterTraits.of(again, draft_max=2), context=64)
        list(runner.generate(list(PROMPT), 12, SamplingParams()))
        learner = again.learner
        made = []  # the weights the optimizer's step left, before any pull
        step = learner.optimizer.step
        learner.optimizer.step = lambda: (step(), made.extend(p.detach().clone() for p in learner.trained))
        assert runner.idle() and len(made) == len(distilled)  # one step
        if pull == 1.0:
            assert all(torch.equal(p, d) for p, d in zip(learner.trained, distilled))
            assert not any(torch.equal(m, d) for m, d in zip(made, distilled))
        else:
            assert all(torch.equal(p, m) for p, m in zip(learner.trained, made))
        learner.unsaved = False
    with pytest.raises(ConfigError, match="learn_anchor"):
        MTPDrafter(learn=True, learn_anchor=1.5)

