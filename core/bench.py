"""`outrider bench`: Outrider beside its peers, in one run, on the same GGUF files, threads and prompt tokens.

Engines (each a small adapter with the same interface: `load()`, then `run(prompt_ids, n_tokens,
temperature, seed) -> RunResult`):

* Outrider: plain (`none`), each drafter (`lookup`, `draft-model` with a bfloat16 copy of the target, since
  no smaller model with the same vocabulary exists for either catalog model; `mtp` with the head `outrider
  distill` cached, skipped with a note where there is none) and the combination `lookup+mtp` (in the
  comma-separated `--drafters` list, + joins the drafters of one configuration), draft length `auto`;
* llama.cpp through llama-cpp-python: plain, and its prompt-lookup decoding (`LlamaPromptLookupDecoding`,
  10 tokens);
* transformers (the GGUF dequantized to float32): plain, and `prompt_lookup_num_tokens=10`.

Peers are optional (`pip install 'outrider[bench]'`); one that does not import is skipped with a note.
llama-cpp-python must be compiled for this CPU without AMX, or ggml dies with "Illegal instruction" (the
default build uses -march=native): `scripts/install-peers` builds it with the right CMAKE_ARGS.

Definitions, the same for every engine: every engine gets the SAME prompt token ids (the model's chat
template applied by Outrider's tokenizer) and produces exactly N new tokens (end-of-generation ignored;
transformers cannot ignore it, so it is forbidden there with `min_new_tokens`). Time is wall clock around
the engine's own streaming interface: prefill tok/s = prompt tokens / time to the first new token; decode
tok/s = tokens after the first delivery / time after it (the first delivery is one token except for
transformers' prompt lookup, which may deliver several at once).

Cells run interleaved: every configuration once per round, a warm-up round first, then `runs` rounds, so
slow drifts of a shared machine hit all configurations alike; the report gives medians, and ratios as the
median over rounds of the ratio within a round (`paired_ratio`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from .errors import ConfigError, OutriderError

# ------------------------------------------------------------------------------------------------------
# Prompts

CODE_FUNCTION = '''def summarize_orders(orders, tax_rate):
    total = 0.0
    count = 0
    largest = None
    by_customer = {}
    for order in orders:
        if order.get("cancelled"):
            continue
        amount = order["quantity"] * order["unit_price"]
        amount = amount * (1 + tax_rate)
        total += amount
        count += 1
        if largest is None or amount > largest:
            largest = amount
        customer = order["customer"]
        if customer not in by_customer:
            by_customer[customer] = 0.0
        by_customer[customer] += amount
    if count == 0:
        return {"total": 0.0, "count": 0, "average": 0.0, "largest": 0.0, "by_customer": {}}
    average = total / count
    top_customer = max(by_customer, key=by_customer.get)
    return {
        "total": round(total, 2),
        "count": count,
        "average": round(average, 2),
        "largest": round(largest, 2),
        "by_customer": by_customer,
        "top_customer": top_customer,
    }'''

SOURCE_PASSAGE = (
    "The city council voted on Tuesday to convert the old railway depot on Harbor Street into a public "
    "library and community workshop. The building, which has stood empty since the freight line closed in "
    "1998, will keep its brick facade and iron roof trusses. \"We want people to see the history of this "
    "place every time they walk in,\" said council member Ana Ruiz, who proposed the plan. The renovation "
    "is expected to cost 14 million dollars, of which 9 million will come from a state grant for historic "
    "buildings and the rest from the city's capital budget. Construction will begin next spring and should "
    "take about two years. The workshop will offer tools for woodworking, electronics and bicycle repair, "
    "and volunteers from the local makers' association have offered to run evening classes. Some residents "
    "worried about parking, but the council noted that the site is two blocks from the central bus station "
    "and will include covered racks for two hundred bicycles.")

PROMPTS: dict[str, str] = {
    # echo-heavy: the answer is mostly a copy of the prompt, where n-gram lookup shines
    "code": "Rename the variable `amount` to `line_total` in this Python function and print the whole "
            "function, unchanged otherwise:\n\n```python\n" + CODE_FUNCTION + "\n```",
    # partial echo: quoted sentences come from the source, the rest is new text
    "summary": "Summarize the following news article in one paragraph, quoting its two or three key sentences "
               "word for word:\n\n" + SOURCE_PASSAGE,
    # nothing to copy: speculation has to pay for itself on fresh text
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}

ENGINES = ("outrider", "llama.cpp", "transformers")
# `a+b` is one configuration combining drafters a and b (`--drafter a,b`): the list itself is comma-separated
DRAFTERS = ("none", "lookup", "draft-model", "mtp", "lookup+mtp")
SINGLE_DRAFTERS = ("none", "lookup", "draft-model", "mtp")
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
PEER_LOOKUP_TOKENS = 10


def prompt_ids(model_path: str | os.PathLike, text: str, chat: bool = True) -> tuple[list[int], bool]:
    """Token ids for `text` (chat template applied when the model has one and `chat`), and whether the
    template was applied. The same ids are fed to every engine, so tokenizers cannot differ."""
    from .chat import apply_chat_template
    from .errors import ModelFileError
    from .gguf_file import GGUFFile
    from .tokenizer import Tokenizer

    gguf = GGUFFile(model_path)
    tokenizer = Tokenizer.from_gguf(gguf)
    if chat:
        try:
            rendered = apply_chat_template(gguf, tokenizer, [{"role": "user", "content": text}])
            return tokenizer.encode(rendered, add_bos=False), True
        except ModelFileError:  # no template in the file and none built in: raw text it is
            pass
    return tokenizer.encode(text), False


# ------------------------------------------------------------------------------------------------------
# Results


@dataclass
class RunResult:
    prefill_s: float
    decode_s: float
    n_prompt: int
    n_generated: int
    n_first: int = 1  # tokens in the first delivery; they count to prefill, not to decode
    drafted: int | None = None
    accepted: int | None = None
    rounds: int | None = None
    acceptance_approximate: bool = False  # counted from outside the engine, not by it
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific detail, kept in the JSON only

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        # None when the first delivery held every token (transformers' lookup on a short run): no decode phase
        if self.n_generated <= self.n_first or self.decode_s <= 0:
            return None
        return (self.n_generated - self.n_first) / self.decode_s

    @property
    def acceptance_rate(self) -> float | None:
        if self.drafted is None or self.accepted is None:
            return None
        return self.accepted / self.drafted if self.drafted else None  # nothing drafted: undefined

    @property
    def mean_acceptance_length(self) -> float | None:
        if self.rounds is None or self.accepted is None:
            return None
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "acceptance_rate", "mean_acceptance_length"):
            row[key] = getattr(self, key)
        return row


METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s", "acceptance_rate", "mean_acceptance_length")


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(runs: list[RunResult]) -> dict[str, float | None]:
    return {key: median(getattr(r, key) for r in runs) for key in METRICS}


def _timed_stream(tokens: Iterator[Any], n_tokens: int, n_prompt: int) -> tuple[RunResult, list]:
    """Consume `tokens` (an iterator of deliveries: one token, or a list of them) until n_tokens arrived;
    the clock starts before the first `next`, since lazy generators do their prefill there."""
    start = time.perf_counter()
    first_at, n_first, got = None, 0, []
    for delivery in tokens:
        got.extend(delivery if isinstance(delivery, list) else [delivery])
        if first_at is None:
            first_at, n_first = time.perf_counter(), len(got)
        if len(got) >= n_tokens:
            break
    end = time.perf_counter()
    close = getattr(tokens, "close", None)
    if close:
        close()
    if first_at is None:
        raise OutriderError("the engine produced no tokens")
    return RunResult(first_at - start, end - first_at, n_prompt, min(len(got), n_tokens), min(n_first, n_tokens)), got


# ------------------------------------------------------------------------------------------------------
# Engines


class Engine:
    """One configuration of one engine on one model file. Subclasses load once and run many times."""

    label = "engine"
    engine = "engine"

    def __init__(self, model_path: str, threads: int):
        self.model_path, self.threads = str(model_path), threads

    def load(self) -> None:
        raise NotImplementedError

    def run(self, prompt_ids: list[int], n_tokens: int, temperature: float, seed: int) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


class OutriderEngine(Engine):
    engine = "outrider"

    def __init__(self, model_path: str, threads: int, drafter: str = "none", draft_max: int | str = "auto"):
        super().__init__(model_path, threads)
        self.drafter, self.draft_max = drafter, draft_max
        self.label = "outrider" if drafter == "none" else f"outrider+{drafter}"
        if drafter == "draft-model":
            self.label += " (bf16 copy)"
        self.assembly = None

    def load(self) -> None:
        from .assembly import assemble
        from .config import resolve_config

        # the sampled acceptor is exactly the greedy one at temperature 0, so one assembly serves both
        flags = {"model": self.model_path, "drafter": self.drafter, "acceptor": "sampled", "draft_max": self.draft_max,
                 # only the draft-model drafter drafts with the target's copy; mtp finds its head in the cache
                 "draft_model": self.model_path if "draft-model" in self.drafter.split("+") else ""}
        # no smaller model of either family exists: a bfloat16 copy of the float32 target drafts
        options = [("drafter.dtype", "bfloat16")] if self.drafter == "draft-model" else []
        self.assembly = assemble(resolve_config(flags, None, {}, options))

    def run(self, prompt_ids, n_tokens, temperature, seed):
        from .sampling import SamplingParams

        runner = self.assembly.runner
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=seed)
        result, _ = _timed_stream(runner.generate(list(prompt_ids), n_tokens, params, frozenset()),
                                  n_tokens, len(prompt_ids))
        stats = runner.stats
        if self.drafter != "none":
            result.drafted, result.accepted, result.rounds = stats.drafted, stats.accepted, stats.rounds
            result.extra = {key: value for key, value in stats.as_dict().items()
                            if key in ("chosen_draft_lengths", "per_position", "draft_s", "verify_s")}
        return result

    def held_bytes(self) -> int:
        model = self.assembly.runner.target.model
        # the built-in architectures list exactly what a token reads; other models get the attribute walk
        return tensor_bytes(model.weight_tensors() if hasattr(model, "weight_tensors") else model)

    def close(self):
        self.assembly = None


class LlamaCppEngine(Engine):
    engine = "llama.cpp"

    def __init__(self, model_path: str, threads: int, lookup: bool = False, context: int = 2048):
        super().__init__(model_path, threads)
        self.lookup, self.context = lookup, context
        self.label = "llama.cpp+lookup" if lookup else "llama.cpp"
        self.llm = None
        self.counter = None

    def load(self):
        import llama_cpp  # noqa: F401  (ImportError = the peer is not installed)

        from llama_cpp import Llama

        kwargs = {}
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.counter = _counting(LlamaPromptLookupDecoding)(num_pred_tokens=PEER_LOOKUP_TOKENS)
            # without logits_all, eval fails with a broadcast ValueError once the context passes n_batch
            kwargs = {"draft_model": self.counter, "logits_all": True}
        self.llm = Llama(model_path=self.model_path, n_ctx=self.context, n_threads=self.threads,
                         n_threads_batch=self.threads, verbose=False, seed=0, **kwargs)

    def run(self, prompt_ids, n_tokens, temperature, seed):
        llm = self.llm
        llm.reset()  # else generate() reuses the KV cache of the same prompt and skips the prefill
        if hasattr(llm, "set_seed"):
            llm.set_seed(seed)
        if self.counter:
            self.counter.reset()
        # generate() never stops on end-of-generation by itself; every warper but temperature is off
        stream = llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0, reset=True)
        result, _ = _timed_stream(stream, n_tokens, len(prompt_ids))
        if self.counter:
            # every decode round is one draft call then one batched eval that emits accepted + 1 tokens
            rounds = self.counter.calls
            result.drafted, result.rounds = self.counter.drafted, rounds
            result.accepted = max(0, result.n_generated - result.n_first - rounds)
            result.acceptance_approximate = True
        return result

    def close(self):
        if self.llm is not None and hasattr(self.llm, "close"):
            self.llm.close()
        self.llm = None


def _counting(draft_class):
    """A subclass of a llama-cpp-python draft model that counts rounds and drafted tokens, which the library
    does not report (a subclass, so it still passes as a LlamaDraftModel)."""

    class Counting(draft_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.reset()

        def reset(self):
            self.calls, self.drafted = 0, 0

        def __call__(self, input_ids, *args, **kwargs):
            draft = super().__call__(input_ids, *args, **kwargs)
            self.calls += 1
            self.drafted += len(draft)
            return draft

    return Counting


class TransformersEngine(Engine):
    engine = "transformers"

    def __init__(self, model_path: str, threads: int, lookup: bool = False):
        super().__init__(model_path, threads)
        self.lookup = lookup
        self.label = "transformers+lookup" if lookup else "transformers"
        self.model = None

    def load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers  # noqa: F401  (ImportError = the peer is not installed)

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # progress bars would interleave with the table
        hf_logging.set_verbosity_error()
        if self.model_path not in _HF_MODELS:  # plain and lookup share one dequantized copy
            path = Path(self.model_path)
            with _quiet_gguf_conversion():
                _HF_MODELS[self.model_path] = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.model = _HF_MODELS[self.model_path]

    def run(self, prompt_ids, n_tokens, temperature, seed):
        streamer = _TimingStreamer()
        input_ids = torch.tensor([list(prompt_ids)])
        kwargs: dict[str, Any] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if temperature > 0:
            kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = PEER_LOOKUP_TOKENS
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                         max_new_tokens=n_tokens, min_new_tokens=n_tokens, streamer=streamer,
                                         pad_token_id=_first(self.model.generation_config.eos_token_id), **kwargs)
        end = time.perf_counter()
        n_generated = output.shape[-1] - input_ids.shape[-1]
        if streamer.first_at is None:
            raise OutriderError("transformers produced no tokens")
        return RunResult(streamer.first_at - start, end - streamer.first_at, len(prompt_ids), n_generated,
                         streamer.n_first)

    def close(self):
        self.model = None
        _HF_MODELS.pop(self.model_path, None)


_HF_MODELS: dict[str, Any] = {}


@contextlib.contextmanager
def _quiet_gguf_conversion():
    """transformers' GGUF conversion draws a tqdm bar that ignores its own progress-bar switch (and tqdm reads
    TQDM_DISABLE at import): silence that one bar for the load, as it would interleave with the table."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original


def _first(ids) -> int:
    """generation_config.eos_token_id may be one id, a list of them, or None; padding needs one."""
    if isinstance(ids, (list, tuple)):
        return int(ids[0]) if ids else 0
    return int(ids) if ids is not None else 0


class _TimingStreamer:
    """transformers streamer protocol: `put` gets the prompt first, then each delivery of new tokens."""

    def __init__(self):
        self.prompt_seen, self.first_at, self.n_first = False, None, 0

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_at is None:
            self.first_at, self.n_first = time.perf_counter(), int(value.numel())

    def end(self):
        pass


def make_engines(engines: Iterable[str], drafters: Iterable[str], model_path: str, threads: int,
                 draft_max: int | str = "auto") -> list[Engine]:
    made: list[Engine] = []
    for engine in engines:
        if engine == "outrider":
            made += [OutriderEngine(model_path, threads, d, draft_max) for d in drafters]
        elif engine == "llama.cpp":
            made += [LlamaCppEngine(model_path, threads, lookup) for lookup in (False, True)]
        elif engine == "transformers":
            made += [TransformersEngine(model_path, threads, lookup) for lookup in (False, True)]
        else:
            raise ConfigError(f"unknown engine '{engine}'; choose from {', '.join(ENGINES)}")
    return made


# ------------------------------------------------------------------------------------------------------
# Memory bandwidth and the bound it puts on decode speed


def read_bandwidth_gbs(size_mb: int = 1024, runs: int = 5) -> float:
    """Sustained read bandwidth: a reduction over a buffer far larger than the cache."""
    buffer = torch.ones(size_mb * (1 << 20) // 4)
    buffer.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


def stored_weight_bytes(gguf) -> int:
    """Bytes of weights read per decoded token as stored in the GGUF. The input embedding is a row gather,
    so it counts only when it doubles as the output head."""
    stored = sum(info.nbytes for name, info in gguf.tensors.items() if name != "token_embd.weight")
    if "output.weight" not in gguf.tensors and "token_embd.weight" in gguf.tensors:
        stored += gguf.tensors["token_embd.weight"].nbytes
    return stored


_EMBEDDING_NAMES = ("embd", "embed", "tok_emb", "wte")


def tensor_bytes(root: Any) -> int:
    """Bytes of every torch tensor reachable from `root` through attributes, containers and nn.Module
    parameters, each storage counted once: a walk instead of a list of names, so it survives rewrites of
    the model classes. A tensor reached only under an embedding-like name is a row gather, not a per-token
    read, and is left out (a tied output head reaches it under another name too)."""
    counted: dict[int, int] = {}
    embedding_only: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, name = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if any(word in name.lower() for word in _EMBEDDING_NAMES):
                embedding_only.setdefault(key, size)
            else:
                counted[key] = size
            continue
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(v, str(k)) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(v, name) for v in obj]
        elif isinstance(obj, torch.nn.Module):
            stack += [(t, n) for n, t in obj.named_parameters(recurse=False)]
            stack += [(t, n) for n, t in obj.named_buffers(recurse=False)]
            stack += [(m, n) for n, m in obj.named_children()]
            stack += [(v, k) for k, v in vars(obj).items() if not k.startswith("_")]
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("outrider", "__main__", "tests")):
            stack += [(v, k) for k, v in vars(obj).items()]
        elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("outrider"):
            stack += [(getattr(obj, s), s) for s in obj.__slots__ if hasattr(obj, s)]
    return sum(counted.values())


# ------------------------------------------------------------------------------------------------------
# The k-token forward cost curve (what the adaptive draft length trades against acceptance)


def forward_cost_curve(model, ks: Iterable[int], prompt_len: int = 128, reps: int = 5) -> dict[int, float]:
    """Median time of one forward over k new tokens, relative to k = 1, after a prompt_len-token prefix."""
    ks = list(ks)
    high = min(1000, model.config.vocab_size)
    cache = model.new_cache(prompt_len + max(ks) + 1)
    model.forward(torch.randint(0, high, (prompt_len,)), 0, cache)
    seconds = {}
    for k in ks:
        block = torch.randint(0, high, (k,))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            model.forward(block, prompt_len, cache)
            times.append(time.perf_counter() - t)
            cache.truncate(prompt_len)
        seconds[k] = statistics.median(times)
    return {k: seconds[k] / seconds[ks[0]] for k in ks}


# ------------------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class BenchSettings:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    tokens: int = 128
    runs: int = 3
    threads: int = 0  # 0 = torch's current setting
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    engines: list[str] = field(default_factory=lambda: list(ENGINES))
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    chat: bool = True
    seed: int = 1
    draft_max: int | str = "auto"
    bandwidth: bool = True
    cost_curve: bool = False

    def check(self) -> None:
        if self.tokens < 2:
            raise ConfigError("--tokens must be at least 2 (one for prefill, one or more for decode)")
        if self.runs < 1:
            raise ConfigError("--runs must be at least 1")
        for p in self.prompts:
            if p not in PROMPTS:
                raise ConfigError(f"unknown prompt '{p}'; choose from {', '.join(PROMPTS)}")
        for e in self.engines:
            if e not in ENGINES:
                raise ConfigError(f"unknown engine '{e}'; choose from {', '.join(ENGINES)}")
        for d in self.drafters:
            parts = d.split("+")
            if any(p not in SINGLE_DRAFTERS for p in parts) or ("none" in parts and len(parts) > 1):
                raise ConfigError(f"unknown drafter '{d}'; choose from {', '.join(SINGLE_DRAFTERS)}, or join "
                                  "drafters with + to combine them (lookup+mtp)")
        for t in self.temperatures:
            if t < 0:
                raise ConfigError(f"temperatures must be >= 0, got {t}")


def run_bench(settings: BenchSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every cell, interleaved; return the report (raw runs and medians), printing notes as it goes."""
    from .catalog import resolve_model
    from .gguf_file import GGUFFile

    settings.check()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    threads = torch.get_num_threads()
    report: dict[str, Any] = {"settings": {**asdict(settings), "threads": threads}, "notes": [],
                              "machine": _machine(), "models": {}}

    def note(text: str) -> None:
        report["notes"].append(text)
        echo(f"note: {text}")

    if settings.bandwidth:
        report["machine"]["read_bandwidth_gbs"] = read_bandwidth_gbs()

    for model in settings.models:
        path = str(resolve_model(model))
        ids, templated = {}, True
        for p in settings.prompts:
            ids[p], applied = prompt_ids(path, PROMPTS[p], settings.chat)
            templated = templated and applied
        if settings.chat and not templated:
            note(f"{model}: no chat template; the prompts are fed as raw text")

        engines = []
        for engine in make_engines(settings.engines, settings.drafters, path, threads, settings.draft_max):
            try:
                engine.load()
                engines.append(engine)
            except ImportError as exc:
                note(f"{model}: {engine.label} skipped: {exc.name or exc} is not installed "
                     "(pip install 'outrider[bench]'; see scripts/install-peers)")
            except Exception as exc:  # a peer that cannot read this file must not sink the rest of the run
                note(f"{model}: {engine.label} skipped: {type(exc).__name__}: {exc}")

        entry: dict[str, Any] = {"path": path, "prompt_tokens": {p: len(v) for p, v in ids.items()},
                                 "chat_template": settings.chat and templated, "cells": []}
        gguf = GGUFFile(path)
        entry["stored_weight_bytes"] = stored_weight_bytes(gguf)
        plain = next((e for e in engines if isinstance(e, OutriderEngine) and e.drafter == "none"),
                     next((e for e in engines if isinstance(e, OutriderEngine)), None))
        if plain is not None:
            entry["held_weight_bytes"] = plain.held_bytes()
        bandwidth = report["machine"].get("read_bandwidth_gbs")
        if bandwidth:
            entry["bound_stored_tokens_per_s"] = bandwidth * 1e9 / entry["stored_weight_bytes"]
            if entry.get("held_weight_bytes"):
                entry["bound_held_tokens_per_s"] = bandwidth * 1e9 / entry["held_weight_bytes"]

        cells = {(p, t, e.label): [] for p in settings.prompts for t in settings.temperatures for e in engines}
        failed: set[str] = set()
        for round_index in range(settings.runs + 1):  # round 0 warms caches, allocators and JITs up
            for p in settings.prompts:
                for t in settings.temperatures:
                    for engine in engines:
                        if engine.label in failed:
                            continue
                        try:
                            result = engine.run(ids[p], settings.tokens, t, settings.seed + round_index)
                        except Exception as exc:
                            failed.add(engine.label)
                            note(f"{model}: {engine.label} failed and is dropped: {type(exc).__name__}: {exc}")
                            continue
                        if round_index:
                            cells[(p, t, engine.label)].append(result)
            echo(f"{model}: {'warm-up' if not round_index else f'run {round_index}/{settings.runs}'} done")

        for (p, t, label), runs in cells.items():
            if not runs:
                continue
            engine = next(e for e in engines if e.label == label)
            entry["cells"].append({"prompt": p, "temperature": t, "engine": engine.engine, "config": label,
                                   "acceptance_approximate": any(r.acceptance_approximate for r in runs),
                                   "median": medians(runs), "runs": [r.as_dict() for r in runs]})
        _add_ratios(entry["cells"])

        if settings.cost_curve and plain is not None:
            curve = forward_cost_curve(plain.assembly.runner.target.model, range(1, 17))
            entry["forward_cost_curve"] = {str(k): v for k, v in curve.items()}
        for engine in engines:
            engine.close()
        del engines, plain
        gc.collect()
        report["models"][model] = entry
    return report


def paired_ratio(runs: list[dict], base: list[dict], key: str = "decode_tokens_per_s") -> float | None:
    """Median over rounds of runs[i][key] / base[i][key]. A round runs every configuration back to back, so
    the ratio within a round is free of the machine's drift between rounds, which a ratio of two medians
    is not (a slow minute that hits one configuration's median run and not the other's)."""
    ratios = [r[key] / b[key] for r, b in zip(runs, base) if r.get(key) is not None and b.get(key)]
    return statistics.median(ratios) if ratios else None


def _references(config: str) -> dict[str, str]:
    """What an Outrider configuration is compared with: its own plain decoding, llama.cpp plain and with
    prompt lookup, and transformers with the same drafter (plain against plain, lookup against lookup)."""
    return {"vs_outrider_plain": "outrider", "vs_llama_cpp": "llama.cpp", "vs_llama_cpp_lookup": "llama.cpp+lookup",
            "vs_transformers": config.replace("outrider", "transformers", 1)}


PAIRED_COLUMNS = {"vs_outrider_plain": "vs Outrider plain", "vs_llama_cpp": "vs llama.cpp",
                  "vs_llama_cpp_lookup": "vs llama.cpp+lookup", "vs_transformers": "vs transformers",
                  "prefill_vs_llama_cpp": "prefill vs llama.cpp"}  # the keys of a cell's "paired"


def _add_ratios(cells: list[dict]) -> None:
    """Per cell, decode speed relative to llama.cpp plain on the same prompt and temperature (paired by
    round); per Outrider cell, the paired ratios against `_references` and prefill against llama.cpp."""
    by = {(c["prompt"], c["temperature"], c["config"]): c for c in cells}
    for c in cells:
        where = (c["prompt"], c["temperature"])
        base = by.get((*where, "llama.cpp"))
        c["median"]["ratio_to_llama_cpp"] = paired_ratio(c["runs"], base["runs"]) if base else None
        if c["engine"] != "outrider":
            continue
        c["paired"] = {}
        for name, reference in _references(c["config"]).items():
            peer = by.get((*where, reference))
            c["paired"][name] = paired_ratio(c["runs"], peer["runs"]) if peer and peer is not c else None
        c["paired"]["prefill_vs_llama_cpp"] = (paired_ratio(c["runs"], base["runs"], "prefill_tokens_per_s")
                                               if base else None)


def _machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__}
    for package in ("llama_cpp", "transformers"):
        try:
            module = __import__(package)
            info[package] = getattr(module, "__version__", "?")
        except Exception:
            info[package] = None
    return info


# ------------------------------------------------------------------------------------------------------
# Output


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    lines = []
    s = report["settings"]
    bandwidth = report["machine"].get("read_bandwidth_gbs")
    lines.append(f"{s['tokens']} new tokens per run (end-of-generation ignored), median of {s['runs']} runs after "
                 f"a warm-up round, {s['threads']} threads, draft length {s['draft_max']}; decode tok/s = tokens "
                 "after the first / time after the first; prefill tok/s = prompt tokens / time to the first "
                 "token. Each run runs every configuration back to back; a ratio (vs ...) is the median over runs "
                 "of the ratio within a run, which the machine's drift from run to run does not move.")
    if bandwidth:
        lines.append(f"Measured DRAM read bandwidth: {bandwidth:.1f} GB/s.")
    for model, entry in report["models"].items():
        lines.append("")
        lines.append(f"### {model}")
        lines.append("")
        prompt_tokens = ", ".join(f"{p} {n}" for p, n in entry["prompt_tokens"].items())
        lines.append(f"Prompt tokens: {prompt_tokens}" + ("" if entry["chat_template"] else " (raw text, no chat template)")
                     + ".")
        bound = []
        if entry.get("bound_stored_tokens_per_s"):
            bound.append(f"{entry['bound_stored_tokens_per_s']:.0f} tok/s at the GGUF's stored weight size "
                         f"({entry['stored_weight_bytes'] / 1e6:.0f} MB/token)")
        if entry.get("bound_held_tokens_per_s"):
            bound.append(f"{entry['bound_held_tokens_per_s']:.0f} tok/s at the size Outrider holds in memory "
                         f"({entry['held_weight_bytes'] / 1e6:.0f} MB/token)")
        if bound:
            lines.append("Bandwidth bound on plain decode: " + "; ".join(bound) + ".")
        lines.append("")
        lines.append("| prompt | T | engine | decode tok/s | prefill tok/s | vs llama.cpp | acceptance rate | "
                     "mean acceptance length |")
        lines.append("|---|---|---|---|---|---|---|---|")
        approximate = False
        for c in entry["cells"]:
            m = c["median"]
            mark = "~" if c["acceptance_approximate"] and m["acceptance_rate"] is not None else ""
            approximate = approximate or bool(mark)
            lines.append(f"| {c['prompt']} | {c['temperature']:g} | {c['config']} | "
                         f"{_fmt(m['decode_tokens_per_s'])} | {_fmt(m['prefill_tokens_per_s'])} | "
                         f"{_fmt(m['ratio_to_llama_cpp'], '.2f', 'x')} | "
                         f"{mark}{_fmt(m['acceptance_rate'], '.2f')} | {mark}{_fmt(m['mean_acceptance_length'], '.2f')} |")
        if approximate:
            lines.append("")
            lines.append("~ counted outside the engine (draft calls and drafted tokens; the last round may be cut).")
        paired = [c for c in entry["cells"] if c.get("paired")]
        if paired:
            lines.append("")
            lines.append("Outrider against each reference, decode tok/s, as the median over runs of the ratio within "
                         "a run (transformers with the same drafter: plain against plain, lookup against lookup):")
            lines.append("")
            lines.append("| prompt | T | engine | " + " | ".join(PAIRED_COLUMNS.values()) + " |")
            lines.append("|---|---|---|" + "---|" * len(PAIRED_COLUMNS))
            for c in paired:
                lines.append(f"| {c['prompt']} | {c['temperature']:g} | {c['config']} | "
                             + " | ".join(_fmt(c["paired"][key], ".2f", "x") for key in PAIRED_COLUMNS) + " |")
        if entry.get("forward_cost_curve"):
            lines.append("")
            lines.append("Outrider: cost of a k-token forward relative to a 1-token forward (median of 5):")
            lines.append("")
            curve = entry["forward_cost_curve"]
            lines.append("| k | " + " | ".join(curve) + " |")
            lines.append("|---|" + "---|" * len(curve))
            lines.append("| cost | " + " | ".join(f"{v:.2f}" for v in curve.values()) + " |")
    if report["notes"]:
        lines.append("")
        lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def write_json(report: dict[str, Any], path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")


def draw_chart(report: dict[str, Any], path: str | os.PathLike) -> bool:
    """Grouped bars of median decode tok/s per prompt/temperature per engine, one panel per model.
    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = [m for m, e in report["models"].items() if e["cells"]]
    if not models:
        return False
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 4.2 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        entry = report["models"][model]
        groups = list(dict.fromkeys((c["prompt"], c["temperature"]) for c in entry["cells"]))
        configs = list(dict.fromkeys(c["config"] for c in entry["cells"]))
        values = {(c["prompt"], c["temperature"], c["config"]): c["median"]["decode_tokens_per_s"]
                  for c in entry["cells"]}
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            xs = [g + (i - (len(configs) - 1) / 2) * width for g in range(len(groups))]
            ys = [values.get((p, t, config)) or 0.0 for p, t in groups]
            ax.bar(xs, ys, width, label=config)
        if entry.get("bound_stored_tokens_per_s"):
            ax.axhline(entry["bound_stored_tokens_per_s"], color="gray", linestyle="--", linewidth=1,
                       label="bandwidth bound (GGUF size)")
        ax.set_xticks(range(len(groups)), [f"{p}, T={t:g}" for p, t in groups])
        ax.set_ylabel("decode tok/s (median)")
        ax.set_title(f"{model}: {report['settings']['tokens']} tokens, {report['settings']['threads']} threads")
        ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["BenchSettings", "DEFAULT_MODELS", "DRAFTERS", "ENGINES", "Engine", "LlamaCppEngine", "OutriderEngine",
           "PROMPTS", "RunResult", "TransformersEngine", "draw_chart", "forward_cost_curve", "make_engines",
           "markdown", "median", "medians", "paired_ratio", "prompt_ids", "read_bandwidth_gbs", "run_bench",
           "stored_weight_bytes", "tensor_bytes", "write_json"]
