"""`outrider distill MODEL`: train an MTP (NextN) head for a model that shipped without one, on the CPU.

The head is one decoder block of the trunk's kind with the nextn tensors around it (see
`outrider.plugins.drafters.mtp.drafter`), initialised from the trunk's last layer. Its row at position p sees the
token x_p and the target's final-normed hidden h_{p-1} (EAGLE's inputs), and is trained to give the target's own
distribution of x_{p+1} (soft cross-entropy to the target's top-K probabilities within the draft vocabulary,
renormalized there, i.e. the KL up to a constant) and, with a small weight, the target's own hidden h_p (EAGLE's
feature term: chained drafts feed the head's h' where the target's h_p would be). With `depth` > 1, drafts
2..depth are trained too, as the drafter chains them (EAGLE-3's training-time test: the head's own h' in, the
shallower drafts' keys in its attention); each depth adds to a step's time (when that pays: docs/bench/mtp.md).
The text: what the target itself writes from a built-in prompt set (code, chat, prose), then as much of the
Python standard library's sources as the budget lets the target read (a prefill gives every position's
distribution at once). The target's hidden states over its own answers are kept as it writes them, so the teacher
reads only the library's text again.

The head's output layer covers a reduced draft vocabulary (FR-Spec): the `draft_vocab` most frequent tokens
of that text, mapped back to target ids in `blk.{n}.nextn.draft_vocab`; its rows are the target's own output
rows, kept frozen. The sidecar GGUF lands at `mtp_sidecar_path(target)`, where `--drafter mtp` looks without
`--draft-model`. Each stage leaves a file beside it (the corpus, the target's distributions, the training
checkpoint), so a stopped run resumes where it stood.
"""

from __future__ import annotations

import math
import pickle
import random
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from outrider.errors import ConfigError
from outrider.io.chat import template_or_raw_ids
from outrider.plugins.drafters.mtp.head import PRECISIONS, TrainableHead, shifted, target_logits
from outrider.plugins.drafters.mtp.prompts import HELD_OUT_PROMPTS, PROMPTS
from outrider.plugins.drafters.mtp.sidecar import DEFAULT_MATRICES, write_sidecar

DISTILLABLE = ("llama", "gemma3", "qwen2", "qwen3")  # trunks whose block TrainableHead copies


@dataclass
class DistillSettings:
    minutes: float = 30.0  # wall-clock budget for the whole run
    # of the budget, at most, for the target writing its own text: its answers are what the head drafts in use,
    # and a share that goes round the prompts a second time paid more than text from the standard library
    # (docs/bench/mtp.md)
    generate_share: float = 0.3
    # of the budget, at most, for the target's distributions over the corpus: more text paid more than more passes
    # over less where steps are quick (docs/bench/mtp.md)
    teacher_share: float = 0.4
    # the teacher stops reading once the steps the rest of the budget buys (at a step time measured before it, one
    # piece of text a step) would pass over its training pieces fewer times than this: where steps are slow (float32
    # on a CPU without bfloat16 arithmetic) more text at the same steps did not pay, and more steps on
    # about the same text did (docs/bench/mtp.md)
    min_passes: float = 3.0
    generate_tokens: int = 256  # per built-in prompt
    # answers written side by side, at most: a decode step reads every weight once for all its rows, so up to
    # where the rows' own arithmetic takes over, more rows cost little more time (docs/bench/mtp.md)
    generate_batch: int = 16
    # times the prompts are answered at most, while the writing share lasts (a long run answers them all in the
    # first part of it): rounds after the first sample every answer at `temperature`, for new text
    generate_rounds: int = 4
    stdlib_chunks: int = 400  # passages offered; the teacher's share of the budget decides how many are read
    seq_len: int = 256
    draft_vocab: int = 8192
    top_k: int = 16  # target probabilities kept per row
    feature_weight: float = 0.1  # of the feature term, beside the KL
    noise: float = 0.0  # uniform noise on the head's input hidden states, U(-noise, noise) x their RMS (EAGLE)
    weight_decay: float = 0.0  # AdamW's, on every trained parameter (norm gains too, as EAGLE's training has it)
    depth: int = 1  # draft positions trained at once, as the drafter chains them (`TrainableHead.chain`)
    precision: str = "auto"  # of the training's matrix products: bf16, fp32, or auto (`TrainableHead.train_step`)
    lr: float = 5e-4  # the peak, after a linear warm-up, of a cosine decay (`learning_rate`)
    steps: int = 0  # total training steps; 0: train until the budget is spent
    held_out: float = 0.1
    max_held_out: int = 16
    seed: int = 0
    fresh: bool = False
    temperature: float = 0.7  # of the target's own generations
    prompts: tuple[str, ...] = PROMPTS
    eval_tokens: int = 64
    matrices: str = DEFAULT_MATRICES  # the sidecar's matrices (`sidecar.MATRICES`)

    @property
    def answer_rounds(self) -> int:
        """Times the prompts are answered at most: a greedy answer is the same every round, so at temperature 0
        only the first is written."""
        return self.generate_rounds if self.temperature else 1


@dataclass
class Sample:
    tokens: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] the target's final-normed hidden states, float16 (memory; resumes alike)
    top_ids: torch.Tensor  # [T, K] indices into the draft vocabulary (of the target's next-token distribution)
    top_p: torch.Tensor  # [T, K]


@dataclass
class DistillReport:
    sidecar: Path
    steps: int
    seconds: float
    heldout_kl_start: float
    heldout_kl_end: float
    head_bytes: int
    per_position: list[float] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ data


def stdlib_texts(n: int, rng: random.Random, chars: int = 4000) -> list[str]:
    """`n` passages of the Python standard library's own sources (code and docstrings)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > chars)
    texts = []
    for path in rng.sample(files, min(n, len(files))):
        text = path.read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(0, max(1, len(text) - chars))
        texts.append(text[start:start + chars])
    return texts


@torch.inference_mode()
def generate(model, prompts: list[list[int]], n: int, temperatures: list[float], generator: torch.Generator,
             stop: set[int], deadline: float = math.inf, hidden: bool = False):
    """The target's own continuations of `prompts`, written side by side (`forward_sequences`: a step of several
    sequences costs little more than a step of one), each sampled at its temperature (greedy at 0) and ending
    at a stop token, after `n` tokens, or where `perf_counter()` passes `deadline` (what is written so far).
    With `hidden`, also each sequence's final-normed hidden states (float16), one row per token the target read:
    the prompt's and those of the answer but its last token, which it never reads."""
    caches = [model.new_cache(len(p) + n + 1) for p in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    last = []
    for p, c, kept in zip(prompts, caches, rows):
        logits, h = model.forward(torch.tensor(p), 0, c, hidden=True, last_only=True)
        last.append(logits[-1])
        if hidden:
            kept.append(h.half())
    logits = torch.stack(last)
    outs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(n):
        tokens = []
        for row, b in zip(logits, active):
            if temperatures[b] > 0:
                token = int(torch.multinomial(torch.softmax(row.float() / temperatures[b], -1), 1, generator=generator))
            else:
                token = int(row.argmax())
            outs[b].append(token)
            tokens.append(token)
        keep = [j for j, token in enumerate(tokens) if token not in stop and len(outs[active[j]]) < n]
        if not keep or time.perf_counter() > deadline:
            break
        active = [active[j] for j in keep]
        logits, h = model.forward_sequences(torch.tensor([tokens[j] for j in keep]), [1] * len(active),
                                            [len(prompts[b]) + len(outs[b]) - 1 for b in active],
                                            [caches[b] for b in active], hidden=True)
        if hidden:
            for b, row in zip(active, h.half()):
                rows[b].append(row[None])
    return (outs, [torch.cat(r) for r in rows]) if hidden else outs


@torch.no_grad()  # not inference_mode: what it returns is trained against
def teacher(model, tokens: list[int], draft_rows: torch.Tensor, top_k: int, hidden: torch.Tensor | None = None) -> Sample:
    """The target's hidden states and its top-k next-token probabilities within the draft vocabulary (`draft_rows`:
    its output rows there). The head drafts no other token, and skipping the rest of the output layer makes the
    teacher markedly faster (docs/bench/mtp.md). `top_ids` index the draft vocabulary, as the loss gathers them.
    `hidden`: the target's hidden states of `tokens`, read while it wrote them; without them, a forward."""
    if hidden is None:  # a prompt-mode forward (every row's hidden kept, no output layer): the fast summation order
        _, hidden = model.forward(torch.tensor(tokens), 0, model.new_cache(len(tokens)), hidden=True, last_only=True)
    p, ids = torch.softmax(target_logits(hidden.float(), draft_rows, model.logit_softcap), -1).topk(top_k, dim=-1)
    return Sample(torch.tensor(tokens), hidden.half(), ids, p / p.sum(-1, keepdim=True))


# ------------------------------------------------------------------------------------------------ the head


def sample_loss(head: TrainableHead, s: Sample, feature_weight: float = 0.0, depth: int = 1, noise: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TrainableHead.loss` on a sample: (loss, the first draft's KL, its feature term). With `noise`, the
    target's hidden states the head reads are perturbed (EAGLE's regulariser against the drift of its own
    chained features) while the feature term's target stays the clean hidden state."""
    hidden = s.hidden.float()
    inputs = hidden
    if noise:
        scale = noise * hidden.pow(2).mean().sqrt()
        inputs = hidden + (2 * torch.rand(hidden.shape, generator=generator) - 1) * scale
    return head.loss(s.tokens, shifted(inputs), hidden, s.top_p, s.top_ids, feature_weight, depth)


def heldout_kl(head: TrainableHead, samples: list[Sample]) -> float:
    with torch.no_grad():
        return float(np.mean([float(sample_loss(head, s)[1]) for s in samples])) if samples else float("nan")


# ------------------------------------------------------------------------------------------------ the sidecar


# ------------------------------------------------------------------------------------------------ the run


def _advance(bar, t0: float) -> None:
    """A `_bar` to the seconds since t0 (never past its end)."""
    bar.update(min(round(time.perf_counter() - t0), bar.total) - bar.n)


def _bar(total: float, desc: str, initial: float = 0):
    from tqdm import tqdm

    return tqdm(total=round(total), initial=round(initial), desc=desc, unit="s",
                bar_format="{desc}: {bar} {n_fmt}/{total_fmt}s [{elapsed}<{remaining}] {postfix}")


def load_trunk(model_name: str):
    """The target to distill from: (path, GGUF file, CPU model, tokenizer); one without MTP blocks, of a trunk
    kind the head can copy."""
    from outrider.catalog import resolve_model
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.plugins.backends.cpu import CPUBackend

    path = resolve_model(model_name)
    g = GGUFFile(path)
    if int(g.arch_key("nextn_predict_layers", 0) or 0):
        raise ConfigError(f"{path.name} already has MTP blocks: use --drafter mtp as it is")
    model = CPUBackend().load_model(g)
    if model.architecture not in DISTILLABLE:
        raise ConfigError(f"distill trains heads for {', '.join(DISTILLABLE)} trunks, not {model.architecture}; "
                          "for Gemma 4 use --drafter gemma-assistant with its assistant file")
    return path, g, model, Tokenizer.from_gguf(g)


def training_text(model, g, tokenizer, settings: DistillSettings, budget: float, rng: random.Random,
                  gen: torch.Generator) -> tuple[list[list[int]], list[torch.Tensor | None], list[tuple]]:
    """The corpus, as token sequences: what the target writes from the built-in prompts, in a seeded order,
    within `budget` seconds (every other one greedily, the rest at the settings' temperature; with every prompt
    answered and time left, they go round again, all at the temperature, up to `generate_rounds` times), then
    standard-library chunks. The teacher reads them in this order, so its own text always goes in. Beside each
    sequence, the target's hidden states of it where it wrote it (its answers; `generate`), else None: the teacher
    need not read those again; and its source (the prompt it answers, the library passage it was cut from), which
    the held-out split keeps on one side."""
    stop = set(tokenizer.eog_ids)
    sequences, rows, sources = [], [], []
    bar = _bar(budget, "target writes training text")
    t0 = time.perf_counter()
    prompts = list(settings.prompts)
    rng.shuffle(prompts)
    size = math.ceil(len(prompts) / math.ceil(len(prompts) / settings.generate_batch))  # groups of even size
    prompt_ids = [template_or_raw_ids(g, tokenizer, text)[0] for text in prompts]
    groups = ((first, round_) for round_ in range(settings.answer_rounds) for first in range(0, len(prompts), size))
    for first, round_ in groups:
        if time.perf_counter() - t0 > budget:
            break
        group = prompt_ids[first:first + size]
        temperatures = [settings.temperature if round_ or (first + j) % 2 else 0.0 for j in range(len(group))]
        outs, hidden = generate(model, group, settings.generate_tokens, temperatures, gen, stop, t0 + budget,
                               hidden=True)
        sequences += [prompt + out for prompt, out in zip(group, outs)]
        rows += hidden
        sources += [("prompt", text) for text in prompts[first:first + size]]
        bar.set_postfix_str(f"{len(sequences)} answers, {sum(map(len, outs))} tokens in the last batch")
        _advance(bar, t0)
    bar.close()
    stdlib = []
    for passage, text in enumerate(stdlib_texts(settings.stdlib_chunks, rng)):
        ids = tokenizer.encode(text)
        for j in range(0, max(1, len(ids) - settings.seq_len // 2), settings.seq_len):
            stdlib.append((ids[j:j + settings.seq_len], ("library passage", passage)))
    rng.shuffle(stdlib)
    return (sequences + [ids for ids, _ in stdlib], rows + [None] * len(stdlib),
            sources + [source for _, source in stdlib])


def draft_vocabulary(sequences: list[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the corpus, ascending (FR-Spec's reduced output layer)."""
    counts = np.bincount(np.concatenate([np.array(s) for s in sequences]), minlength=vocab_size)
    frequent = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(frequent).astype(np.int64))


def teacher_split(model, sequences: list[list[int]], rows: list[torch.Tensor | None], vocab_ids: torch.Tensor,
                  settings: DistillSettings, budget: float, enough: Callable[[int], bool] | None = None,
                  sources: list | None = None) -> tuple[list[Sample], list[Sample]]:
    """The target's distributions over the corpus cut into pieces, in the corpus' order, within `budget`
    seconds or until `enough(training pieces read)` (pieces not reached are left out), split into (held-out,
    training) by whole sources (`held_out_indices`; the sequences' `sources`, else each sequence its own). A
    sequence with its hidden states (`rows`, one per token but its last) costs only the draft vocabulary's output
    rows; a piece of it past the first keeps the states of the whole answer before it, as the target has them when
    it drafts."""
    draft_rows = model.output.rows(vocab_ids).float()
    pieces = []
    for i, (s, h) in enumerate(zip(sequences, rows)):
        s = s if h is None else s[:len(h)]
        source = sources[i] if sources is not None else i
        pieces += [(s[j:j + settings.seq_len], None if h is None else h[j:j + settings.seq_len], source)
                   for j in range(0, len(s), settings.seq_len)]
    pieces = [(p, h, source) for p, h, source in pieces if len(p) >= 8]
    samples, piece_sources, read, t0 = [], [], 0, time.perf_counter()
    bar = _bar(budget, "the target's distributions")
    for piece, hidden, source in pieces:
        if samples and (time.perf_counter() - t0 > budget or (enough is not None and enough(
                len(samples) - len(held_out_indices(piece_sources, settings))))):
            break
        samples.append(teacher(model, piece, draft_rows, settings.top_k, hidden))
        piece_sources.append(source)
        read += len(piece)
        bar.set_postfix_str(f"{len(samples)} sequences, {read} tokens")
        _advance(bar, t0)
    bar.close()
    held_at = set(held_out_indices(piece_sources, settings))
    held = [s for i, s in enumerate(samples) if i in held_at]
    train = [s for i, s in enumerate(samples) if i not in held_at]
    return held, train or held  # one piece read: trained on and held out both


def held_out_indices(piece_sources: list, settings: DistillSettings) -> list[int]:
    """Which pieces (given by their sources: the prompt an answer came from, the passage a piece of the library was
    cut from) are held out: whole sources, so the held-out KL is measured on prompts training never saw. Sources
    join in an order drawn for each from the seed (so the split moves little as pieces are read) while the pieces
    held stay within `held_out_count`, never every source. Where no whole source fits (a short run) or there is
    only one, that many pieces of the smallest are held out and the rest of it trained on, as a split by pieces."""
    n_held = held_out_count(len(piece_sources), settings)
    sizes = Counter(piece_sources)
    order = sorted(sizes, key=lambda source: random.Random(f"{settings.seed}:{source}").random())
    held, count = set(), 0
    for source in order:
        if count + sizes[source] <= n_held and len(held) + 1 < len(sizes):
            held.add(source)
            count += sizes[source]
    if held:
        return [i for i, source in enumerate(piece_sources) if source in held]
    smallest = min(order, key=sizes.__getitem__)
    pieces = [i for i, source in enumerate(piece_sources) if source == smallest]
    return pieces[:min(n_held, max(len(piece_sources) - 1, 1))]


def held_out_count(n: int, settings: DistillSettings) -> int:
    """Of `n` pieces of text, how many are held out from training (at least one: the KL is reported on them)."""
    return min(max(1, int(n * settings.held_out)), settings.max_held_out)


def step_seconds(model, g, vocab_ids: torch.Tensor, settings: DistillSettings) -> float:
    """The seconds a training step on a full-length piece takes here, timed on a throwaway head (copies of the
    trunk's weights, its own optimizer and generator: the run's head and random draws are untouched) and a made-up
    sample (the mean of two steps after one that warms up)."""
    head = TrainableHead(model, g, vocab_ids)
    optimizer = head.optimizer(settings.lr, settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    n = settings.seq_len
    tokens = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
    hidden = torch.randn(n, model.config.hidden_size, generator=gen).to(model.device)
    s = teacher(model, tokens, model.output.rows(vocab_ids).float(), settings.top_k, hidden)
    times = []
    for step in range(3):
        t0 = time.perf_counter()
        train_step(head, optimizer, s, step, settings)
        times.append(time.perf_counter() - t0)
    return max(sum(times[1:]) / 2, 1e-9)


# of the stage files; a file of another form is made again. Teacher files from before the teacher kept to the draft
# vocabulary stay valid on purpose: their top-k, mapped into it, differs little and trains the same head; so do
# corpus files from before the target's states of its answers were kept (the teacher reads those answers again),
# and those from before sources were kept (each sequence its own source: answers to one prompt, and pieces of one
# library passage, may then fall on both sides of the held-out split, as teacher files made before keep them)
STAGE_FORM = 2


def corpus_key(settings: DistillSettings) -> tuple:
    """What the stage files depend on: a file made with other values of these is made again."""
    return (settings.generate_tokens, settings.stdlib_chunks, settings.seq_len, settings.draft_vocab, settings.top_k,
            settings.seed, settings.temperature, settings.prompts, settings.generate_batch,
            settings.answer_rounds)


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """The training samples' order in `epoch`: a function of the step alone, so a resumed run sees what an
    uninterrupted one would."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


WARMUP = 0.05  # of the run, a linear rise to the peak learning rate


def learning_rate(peak: float, done: float) -> float:
    """A linear warm-up over the first `WARMUP` of the run, then cosine decay from `peak` to a tenth of it (`done`
    from 0 to 1: by steps when a step count is set, else by the training seconds of the budget; a resumed run goes
    on along the same curve, compressed when its --minutes leave less than the rest). Adam's first steps move every
    weight of the initialised block by about the rate: rising to the peak keeps the result from hanging on which
    samples come first (docs/bench/mtp.md)."""
    done = min(max(done, 0.0), 1.0)
    if done < WARMUP:
        return peak * (0.02 + 0.98 * done / WARMUP)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (done - WARMUP) / (1 - WARMUP))))


def train_step(head: TrainableHead, optimizer: torch.optim.Optimizer, s: Sample, step: int,
               settings: DistillSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on sample `s` as training step number `step`: (the first draft's KL, its feature term)."""
    # the noise drawn from the step alone, so a resumed run perturbs as an uninterrupted one would
    noise_rng = torch.Generator().manual_seed(settings.seed * 1_000_003 + step) if settings.noise else None
    return head.train_step(optimizer, lambda: sample_loss(head, s, settings.feature_weight, settings.depth,
                                                          settings.noise, noise_rng), settings.precision)


def train(head: TrainableHead, optimizer: torch.optim.Optimizer, samples: list[Sample], step: int,
          settings: DistillSettings, budget: float, spent: float, save: Callable[[int, float], None],
          on_step: Callable[[int], None] | None = None) -> int:
    """Train from `step` up to `settings.steps` steps in all, or when that is 0 until `budget` seconds of
    training are spent (`spent` of them before this call), saving a checkpoint (`save(step, seconds spent)`)
    every two minutes and on an interrupt; the step count reached."""
    bar = None if settings.steps else _bar(budget, "training the MTP head", spent)
    t0, last_save = time.perf_counter() - spent, time.perf_counter()  # t0: when the training would have begun
    order, epoch = None, -1
    try:
        while (step < settings.steps) if settings.steps else (time.perf_counter() - t0 < budget):
            if step // len(samples) != epoch:
                epoch = step // len(samples)
                order = epoch_order(len(samples), epoch, settings.seed)
            s = samples[order[step % len(samples)]]
            done = step / settings.steps if settings.steps else (time.perf_counter() - t0) / max(budget, 1e-9)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(settings.lr, done)
            kl, feature = train_step(head, optimizer, s, step, settings)
            step += 1
            if bar is not None:
                bar.set_postfix_str(f"step {step} KL {kl.item():.3f} feature {feature.item():.3f}")
                _advance(bar, t0)
            if time.perf_counter() - last_save > 120:
                save(step, time.perf_counter() - t0)
                last_save = time.perf_counter()
            if on_step is not None:
                on_step(step)
    except KeyboardInterrupt:
        save(step, time.perf_counter() - t0)
        raise
    finally:
        if bar is not None:
            bar.close()
    return step


def distill(model_name: str, settings: DistillSettings, out: Path | None = None,
            echo: Callable[[str], None] = print, on_step: Callable[[int], None] | None = None) -> DistillReport:
    """The whole run, resumable at every stage: the trunk; the corpus and draft vocabulary; the target's
    distributions; training (checkpointed); the sidecar; the held-out evaluation. The budget goes at most
    `generate_share` to writing text and `teacher_share` to the distributions (less where training could not pass
    over more text `min_passes` times), and training ends with 5% left for the sidecar and the check. An interrupt
    (Ctrl-C) during training saves where it stood."""
    from outrider.plugins.drafters.mtp.drafter import mtp_sidecar_path

    if settings.depth < 1:
        raise ConfigError(f"--depth {settings.depth}: the head trains at least its first draft; pass --depth 1 or more")
    if settings.noise < 0 or settings.weight_decay < 0:
        raise ConfigError(f"--noise {settings.noise} --weight-decay {settings.weight_decay}: pass values >= 0 "
                          "(0 turns either off)")
    if settings.precision not in PRECISIONS:
        raise ConfigError(f"--precision {settings.precision}: pass {', '.join(PRECISIONS[:-1])} or "
                          f"{PRECISIONS[-1]}")
    start = time.perf_counter()
    deadline = start + settings.minutes * 60
    reserve = 0.05 * settings.minutes * 60  # of the budget, after training: the sidecar and the check
    rng, gen = random.Random(settings.seed), torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    path, g, model, tokenizer = load_trunk(model_name)
    out = out or mtp_sidecar_path(path)
    files = {stage: out.with_suffix(f".{stage}.pt") for stage in ("corpus", "teacher", "distill")}
    if settings.fresh:
        for file in files.values():
            file.unlink(missing_ok=True)
    files["corpus"].parent.mkdir(parents=True, exist_ok=True)

    def load(stage: str):
        if not files[stage].is_file():
            return None
        try:
            state = torch.load(files[stage], weights_only=False)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            echo(f"{files[stage]} is unreadable (a run stopped while writing it?): making it again")
            return None
        if state.get("form") != (STAGE_FORM, corpus_key(settings)):
            echo(f"{files[stage]} was made by another distill or other settings: making it again")
            return None
        return state

    def store(stage: str, state: dict) -> None:  # whole or not at all: a stop while writing leaves the old file
        partial = files[stage].with_suffix(".partial")
        torch.save({**state, "form": (STAGE_FORM, corpus_key(settings))}, partial)
        partial.replace(files[stage])

    corpus = load("corpus")
    if corpus is None:
        sequences, rows, sources = training_text(model, g, tokenizer, settings,
                                                 settings.generate_share * settings.minutes * 60, rng, gen)
        corpus = {"sequences": sequences, "rows": rows, "sources": sources,
                  "vocab_ids": draft_vocabulary(sequences, model.config.vocab_size, settings.draft_vocab)}
        store("corpus", corpus)
    else:
        echo(f"resuming from {files['corpus']}")
    vocab_ids = corpus["vocab_ids"]
    data = load("teacher")
    if data is None:
        rows = corpus.get("rows") or [None] * len(corpus["sequences"])  # a corpus from before rows were kept
        enough = None
        if not settings.steps:
            seconds, train_end = step_seconds(model, g, vocab_ids, settings), deadline - reserve
            echo(f"a training step takes {seconds:.2f} s here: the target reads no more text than the training left "
                 f"can pass over {settings.min_passes:g} times")
            enough = lambda pieces: pieces * settings.min_passes >= (train_end - time.perf_counter()) / seconds
        held, train_samples = teacher_split(model, corpus["sequences"], rows, vocab_ids, settings,
                                            min(settings.teacher_share * settings.minutes * 60,
                                                max(deadline - time.perf_counter(), 0)), enough,
                                            corpus.get("sources"))  # none in a corpus from before sources
        store("teacher", {"held": held, "train": train_samples})
    else:
        echo(f"reading the target's distributions from {files['teacher']}")
        held, train_samples = data["held"], data["train"]

    head = TrainableHead(model, g, vocab_ids)
    optimizer = head.optimizer(settings.lr, settings.weight_decay)
    state, step = load("distill"), 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # the saved groups carry the earlier run's decay: this run's holds
            group["weight_decay"] = settings.weight_decay
        step = state["step"]
        echo(f"resuming training at step {step}")
    kl_now = heldout_kl(head, held)
    kl_start = state["kl_start"] if state is not None else kl_now  # the untrained head's, kept across resumes
    tokens = sum(len(s.tokens) for s in train_samples)
    echo(f"{len(train_samples)} training sequences ({tokens} tokens) and {len(held)} held out; draft vocabulary "
         f"{len(vocab_ids)} of {model.config.vocab_size}; held-out KL {kl_now:.3f} nats")

    saved = {}

    # a run stopped before its training budget was spent goes on with the rest of it (no more than this run's
    # budget allows), along the same learning rate curve; a finished run run again trains further, for a new
    # budget. A run bound by --steps keeps no time budget.
    budget, spent = max(deadline - time.perf_counter() - reserve, 0), 0.0
    if settings.steps:
        budget = 0.0
    elif state is not None and state.get("seconds", 0.0) < state.get("budget", 0.0):
        budget, spent = min(state["budget"], state["seconds"] + budget), state["seconds"]
        echo(f"{(budget - spent) / 60:.1f} of its {state['budget'] / 60:.1f} training minutes left")
    elif state is not None and (not out.is_file() or out.stat().st_mtime < files["distill"].stat().st_mtime):
        budget = spent = state.get("seconds", 0.0)  # trained, stopped before the sidecar was written: write it
        echo("training was done; writing the sidecar")

    def save(step: int, seconds: float) -> None:
        store("distill", {"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                          "kl_start": kl_start, "seconds": seconds, "budget": budget})
        saved["step"] = step

    t_train = time.perf_counter()
    try:
        step = train(head, optimizer, train_samples, step, settings, budget, spent, save, on_step)
    except KeyboardInterrupt:
        echo(f"interrupted at step {saved['step']}: saved {files['distill']}; the same command resumes from there")
        raise
    save(step, max(spent + time.perf_counter() - t_train, budget))  # finished: run again, it trains anew
    kl_end = heldout_kl(head, held)
    size = write_sidecar(out, head, g, vocab_ids, settings.matrices)
    # a copy `drafter.learn` kept of an earlier distill's head is no longer what this sidecar came from
    out.with_suffix(".distilled.gguf").unlink(missing_ok=True)
    report = DistillReport(out, step, time.perf_counter() - start, kl_start, kl_end, size)
    echo(f"held-out KL {kl_start:.3f} -> {kl_end:.3f} nats after {step} steps; wrote {out} ({size / 1e6:.1f} MB)")
    if settings.eval_tokens:
        report.per_position = heldout_acceptance(model, g, tokenizer, out, settings.eval_tokens)
        echo("held-out greedy acceptance per draft position: " +
             ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(report.per_position)))
    return report


def heldout_acceptance(model, g, tokenizer, sidecar: Path, n: int, draft_max: int = 3) -> list[float]:
    """Per draft position, the share of drafts the target accepted, generating greedily from prompts that
    were not trained on (the real drafter on the written sidecar, three drafts every round)."""
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.backends.cpu import CPUBackend
    from outrider.plugins.drafters.mtp.drafter import MTPDrafter
    from outrider.spec.drafter import Target
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    target = Target(model=model, tokenizer=tokenizer, gguf=g, backend=CPUBackend())
    drafter = MTPDrafter(model=str(sidecar))
    drafter.setup(target)
    runner = Runner(target, drafter, GreedyAcceptor(), DrafterTraits.of(drafter, draft_max=draft_max), context=1024)
    drafted, accepted = [0] * draft_max, [0] * draft_max
    for text in HELD_OUT_PROMPTS:
        list(runner.generate(template_or_raw_ids(g, tokenizer, text)[0], n, SamplingParams()))
        for j, (d, a) in enumerate(zip(runner.stats.drafted_at, runner.stats.accepted_at)):
            drafted[j] += d
            accepted[j] += a
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
