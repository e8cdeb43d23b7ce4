"""`outrider distill MODEL`: train an MTP (NextN) head for a model that shipped without one, on the CPU.

The head is one decoder block of the trunk's kind with the nextn tensors around it (see
`outrider.plugins.drafters.mtp.drafter`), initialised from the trunk's last layer. Its row at position p sees the
token x_p and the target's final-normed hidden h_{p-1}, and is trained to give the target's own distribution
of x_{p+1} (soft cross-entropy to the target's top-K probabilities, i.e. the KL up to a constant) over:
text the target itself writes from a built-in, varied prompt set (chat, code, prose, quoting), and chunks of
the Python standard library's sources and docstrings, which ship with every Python.

The head's output layer covers a reduced draft vocabulary (FR-Spec): the `draft_vocab` most frequent tokens
of that text, mapped back to target ids in `blk.{n}.nextn.draft_vocab`; it starts from the target's output
rows. The sidecar GGUF lands at `mtp_sidecar_path(target)`, where `--drafter mtp` looks without
`--draft-model`. A checkpoint beside it makes a stopped run resumable.
"""

from __future__ import annotations

import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from outrider.errors import ConfigError
from outrider.io.chat import template_or_raw_ids
from outrider.models.llama import permute_qk
from outrider.plugins.drafters.mtp.head import TrainableHead

PROMPTS = (
    "Explain how a hash table works, with a short example in Python.",
    "Write a friendly email to a colleague asking to move our meeting to Thursday.",
    "Write a short story about a fox who learns to read.",
    "What are the main causes of the French Revolution? Answer in a few paragraphs.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "Translate to French: 'The weather is lovely today, let us go for a walk in the park.'",
    "Summarize the plot of Romeo and Juliet, quoting one famous line word for word.",
    "List five tips for keeping houseplants healthy.",
    "Write a bash one-liner that counts the lines of every .py file in a folder, and explain it.",
    "Describe the water cycle to a ten-year-old.",
    "Write a haiku about autumn, then a limerick about a cat.",
    "Repeat this sentence exactly, then rephrase it: 'Small steps every day add up to big results.'",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
    "Write a dialogue between a teacher and a student about why the sky is blue.",
)
HELD_OUT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain recursion to a beginner programmer, with an example.",
)


@dataclass
class DistillSettings:
    minutes: float = 30.0  # wall-clock budget for the whole run
    generate_tokens: int = 160  # per built-in prompt
    stdlib_chunks: int = 16
    seq_len: int = 128
    draft_vocab: int = 8192
    top_k: int = 16  # target probabilities kept per row
    lr: float = 3e-4
    steps: int = 0  # 0: train until the budget is spent
    held_out: float = 0.1
    seed: int = 0
    fresh: bool = False
    temperature: float = 0.7  # of the target's own generations
    prompts: tuple[str, ...] = PROMPTS
    eval_tokens: int = 64


@dataclass
class Sample:
    tokens: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] the target's final-normed hidden states
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
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > chars)
    texts = []
    for path in rng.sample(files, min(n, len(files))):
        text = path.read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(0, max(1, len(text) - chars))
        texts.append(text[start:start + chars])
    return texts


@torch.inference_mode()
def generate(model, prompt: list[int], n: int, temperature: float, generator: torch.Generator,
             stop: set[int]) -> list[int]:
    """The target's own continuation of `prompt` (sampled at `temperature`; greedy at 0)."""
    cache = model.new_cache(len(prompt) + n + 1)
    logits = model.forward(torch.tensor(prompt), 0, cache, last_only=True)[-1]
    out = []
    for i in range(n):
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator))
        else:
            token = int(logits.argmax())
        out.append(token)
        if token in stop:
            break
        logits = model.forward(torch.tensor([token]), len(prompt) + i, cache)[-1]
    return out


@torch.no_grad()  # not inference_mode: what it returns is trained against
def teacher(model, tokens: list[int], vocab_index: torch.Tensor, top_k: int) -> Sample:
    """The target's hidden states and top-k next-token probabilities (restricted to the draft vocabulary)."""
    # a prompt-mode forward (every row's hidden kept): the fast summation order, as a prefill
    _, hidden = model.forward(torch.tensor(tokens), 0, model.new_cache(len(tokens)), hidden=True, last_only=True)
    logits = model.output(hidden, softcap=model.logit_softcap, prompt=True)
    probs = torch.softmax(logits.float().clone(), -1)
    p, ids = probs.topk(top_k, dim=-1)
    mapped = vocab_index[ids]
    p = torch.where(mapped >= 0, p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return Sample(torch.tensor(tokens), hidden.float().clone(), mapped.clamp_min(0), p)


# ------------------------------------------------------------------------------------------------ the head


def shifted(hidden: torch.Tensor) -> torch.Tensor:
    """h_{p-1} for every row p (a zero row before position 0, as the drafter does)."""
    return torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])


def sample_loss(head: TrainableHead, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy, KL) averaged over rows: row p's target is the target's distribution of x_{p+1}."""
    logits, _ = head(s.tokens, shifted(s.hidden))
    logq = torch.log_softmax(logits, -1).gather(1, s.top_ids)
    ce = -(s.top_p * logq).sum(-1).mean()
    entropy = -(s.top_p * s.top_p.clamp_min(1e-12).log()).sum(-1).mean()
    return ce, ce - entropy


def heldout_kl(head: TrainableHead, samples: list[Sample]) -> float:
    with torch.no_grad():
        return float(np.mean([float(sample_loss(head, s)[1]) for s in samples])) if samples else float("nan")


# ------------------------------------------------------------------------------------------------ the sidecar


def write_sidecar(path: Path, head: TrainableHead, g, vocab_ids: torch.Tensor) -> int:
    """The trained head as an MTP-only GGUF in llama.cpp's nextn layout (block `n_trunk`); its size in bytes."""
    import gguf

    arch, cfg = head.arch, head.cfg
    b = cfg.n_layers
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, value in g.metadata.items():
        if not key.startswith(arch + ".") or key in (f"{arch}.block_count", f"{arch}.nextn_predict_layers"):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list) and key.endswith("sliding_window_pattern"):
            w.add_array(key, list(value) + [head.layer.window is not None])
    w.add_block_count(b + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    p = f"blk.{b}."
    for name, param in head.w.items():
        t = param.detach().float()
        if arch == "llama" and name in ("attn_q", "attn_k"):
            t = permute_qk(cfg.n_heads if name == "attn_q" else cfg.n_kv_heads)(t)
        nextn = name in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "shared_head_head")
        array = t.numpy().astype(np.float16 if t.dim() == 2 else np.float32)
        w.add_tensor(p + ("nextn." if nextn else "") + name + ".weight", array)
    w.add_tensor(p + "nextn.draft_vocab", vocab_ids.numpy().astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path.stat().st_size


# ------------------------------------------------------------------------------------------------ the run


def _bar(total: float, desc: str):
    from tqdm import tqdm

    return tqdm(total=round(total), desc=desc, unit="s", bar_format="{desc}: {bar} {n_fmt}/{total_fmt}s "
                "[{elapsed}<{remaining}] {postfix}")


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
    if model.architecture not in ("llama", "gemma3"):
        raise ConfigError(f"distill supports llama and gemma3 trunks, not {model.architecture}")
    return path, g, model, Tokenizer.from_gguf(g)


def training_text(model, g, tokenizer, settings: DistillSettings, budget: float, rng: random.Random,
                  gen: torch.Generator) -> list[list[int]]:
    """The corpus, as token sequences: what the target writes from the built-in prompts (within `budget`
    seconds; every third greedily, the rest at the settings' temperature), then standard-library chunks."""
    stop = set(tokenizer.eog_ids)
    sequences = []
    bar = _bar(budget, "target writes training text")
    t0 = time.perf_counter()
    for i, text in enumerate(settings.prompts):
        if time.perf_counter() - t0 > budget:
            break
        prompt, _ = template_or_raw_ids(g, tokenizer, text)
        temperature = settings.temperature if i % 3 else 0.0
        sequences.append(prompt + generate(model, prompt, settings.generate_tokens, temperature, gen, stop))
        bar.update(min(round(time.perf_counter() - t0), bar.total) - bar.n)
    bar.close()
    for text in stdlib_texts(settings.stdlib_chunks, rng):
        ids = tokenizer.encode(text)
        for j in range(0, max(1, len(ids) - settings.seq_len // 2), settings.seq_len):
            sequences.append(ids[j:j + settings.seq_len])
    return sequences


def draft_vocabulary(sequences: list[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the corpus, ascending (FR-Spec's reduced output layer)."""
    counts = np.bincount(np.concatenate([np.array(s) for s in sequences]), minlength=vocab_size)
    frequent = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(frequent).astype(np.int64))


def teacher_split(model, sequences: list[list[int]], vocab_ids: torch.Tensor, settings: DistillSettings,
                  budget: float) -> tuple[list[Sample], list[Sample]]:
    """The target's distributions over the corpus cut into pieces, shuffled, within `budget` seconds (pieces
    not reached are left out, unless a fixed step count asks for all), split into (held-out, training)."""
    from tqdm import tqdm

    vocab_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vocab_index[vocab_ids] = torch.arange(len(vocab_ids))
    pieces = [s[j:j + settings.seq_len] for s in sequences for j in range(0, len(s), settings.seq_len)]
    pieces = [p for p in pieces if len(p) >= 8]
    order = list(range(len(pieces)))
    random.Random(settings.seed + 1).shuffle(order)
    samples, t0 = [], time.perf_counter()
    for i in tqdm(order, desc="the target's distributions", unit="seq", leave=False):
        if samples and time.perf_counter() - t0 > budget and not settings.steps:
            break
        samples.append(teacher(model, pieces[i], vocab_index, settings.top_k))
    n_held = max(1, int(len(samples) * settings.held_out))
    return samples[:n_held], samples[n_held:] or samples[:1]


def train(head: TrainableHead, optimizer: torch.optim.Optimizer, samples: list[Sample], step: int,
          settings: DistillSettings, budget: float, save: Callable[[int], None]) -> int:
    """Train from `step` for `settings.steps` steps, or for `budget` seconds when that is 0, saving a
    checkpoint every two minutes; the step count reached."""
    bar = None if settings.steps else _bar(budget, "training the MTP head")
    t0, last_save = time.perf_counter(), time.perf_counter()
    target_steps = step + settings.steps
    while (step < target_steps) if settings.steps else (time.perf_counter() - t0 < budget):
        s = samples[step % len(samples)]
        ce, kl = sample_loss(head, s)
        optimizer.zero_grad()
        ce.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if bar is not None:
            bar.set_postfix_str(f"step {step} KL {kl.item():.3f}")
            bar.update(min(round(time.perf_counter() - t0), bar.total) - bar.n)
        if time.perf_counter() - last_save > 120:
            save(step)
            last_save = time.perf_counter()
    if bar is not None:
        bar.close()
    return step


def distill(model_name: str, settings: DistillSettings, out: Path | None = None,
            echo: Callable[[str], None] = print) -> DistillReport:
    """The whole run, resumable: the trunk, the corpus and draft vocabulary (or the checkpoint's), the
    target's distributions, training, the sidecar, and the held-out evaluation. The time budget goes 30% to
    writing text, half of the rest at most to the target's distributions, and training ends with 10% left."""
    from outrider.plugins.drafters.mtp.drafter import mtp_sidecar_path

    start = time.perf_counter()
    deadline = start + settings.minutes * 60
    rng, gen = random.Random(settings.seed), torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    path, g, model, tokenizer = load_trunk(model_name)
    out = out or mtp_sidecar_path(path)
    checkpoint = out.with_suffix(".distill.pt")
    state = torch.load(checkpoint, weights_only=False) if checkpoint.is_file() and not settings.fresh else None

    if state is not None:
        echo(f"resuming from {checkpoint} (step {state['step']})")
        sequences, vocab_ids = state["sequences"], state["vocab_ids"]
    else:
        sequences = training_text(model, g, tokenizer, settings, 0.3 * (deadline - time.perf_counter()), rng, gen)
        vocab_ids = draft_vocabulary(sequences, model.config.vocab_size, settings.draft_vocab)
    held, train_samples = teacher_split(model, sequences, vocab_ids, settings,
                                        0.5 * max(deadline - time.perf_counter(), 0))

    head = TrainableHead(model, g, vocab_ids)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    kl_now = heldout_kl(head, held)
    kl_start = state["kl_start"] if state is not None else kl_now  # the untrained head's, kept across resumes
    echo(f"{len(train_samples)} training and {len(held)} held-out sequences; draft vocabulary {len(vocab_ids)} of "
         f"{model.config.vocab_size}; held-out KL {kl_now:.3f} nats")

    def save(step: int) -> None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "sequences": sequences, "vocab_ids": vocab_ids, "kl_start": kl_start}, checkpoint)

    budget = max(deadline - time.perf_counter() - 0.1 * settings.minutes * 60, 0)
    step = train(head, optimizer, train_samples, step, settings, budget, save)
    save(step)
    kl_end = heldout_kl(head, held)
    size = write_sidecar(out, head, g, vocab_ids)
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
