"""One adapter per engine configuration, each with the same interface: `load()`, then
`run(prompt_ids, n_tokens, temperature, top_p, seed) -> RunResult`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from outrider.bench.costs import tensor_bytes
from outrider.bench.results import RunResult, timed_stream
from outrider.errors import ConfigError, OutriderError

ENGINES = ("outrider", "llama.cpp", "llama-bench", "transformers")
LLAMA_BENCH_VARIABLE = "LLAMA_BENCH"  # where llama-bench is, when --llama-bench does not say
# `a+b` is one configuration combining drafters a and b (`--drafter a,b`): the list itself is comma-separated
DRAFTERS = ("none", "lookup", "draft-model", "mtp", "lookup+mtp")
SINGLE_DRAFTERS = ("none", "lookup", "draft-model", "mtp")
PEER_LOOKUP_TOKENS = 10


class Engine:
    """One configuration of one engine on one model file. Subclasses load once and run many times."""

    label = "engine"
    engine = "engine"

    def __init__(self, model_path: str, threads: int):
        self.model_path, self.threads = str(model_path), threads

    def load(self) -> None:
        raise NotImplementedError

    def run(self, prompt_ids: list[int], n_tokens: int, temperature: float, top_p: float, seed: int) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


class OutriderEngine(Engine):
    engine = "outrider"

    def __init__(self, model_path: str, threads: int, drafter: str = "none", draft_max: int | str = "auto",
                 options: Iterable[tuple[str, str]] = ()):
        super().__init__(model_path, threads)
        self.drafter, self.draft_max, self.options = drafter, draft_max, list(options)
        self.label = "outrider" if drafter == "none" else f"outrider+{drafter}"
        if drafter == "draft-model":
            self.label += " (bf16 copy)"
        self.assembly = None

    def load(self) -> None:
        from outrider.assembly import assemble
        from outrider.config import resolve_config

        # the sampled acceptor is exactly the greedy one at temperature 0, so one assembly serves both
        flags = {"model": self.model_path, "drafter": self.drafter, "acceptor": "sampled", "draft_max": self.draft_max,
                 # only the draft-model drafter drafts with the target's copy; mtp finds its head in the cache
                 "draft_model": self.model_path if "draft-model" in self.drafter.split("+") else ""}
        # no smaller model of either family exists: a bfloat16 copy of the float32 target drafts
        options = [("drafter.dtype", "bfloat16")] if self.drafter == "draft-model" else []
        self.assembly = assemble(resolve_config(flags, None, {}, options + self.options))

    def run(self, prompt_ids, n_tokens, temperature, top_p, seed):
        from outrider.spec.sampling import SamplingParams

        runner = self.assembly.runner
        params = SamplingParams(temperature=temperature, top_k=0, top_p=top_p, seed=seed)
        result, _ = timed_stream(runner.generate(list(prompt_ids), n_tokens, params, frozenset()),
                                  n_tokens, len(prompt_ids))
        stats = runner.stats
        if self.drafter != "none":
            result.drafted, result.accepted, result.rounds = stats.drafted, stats.accepted, stats.rounds
            result.extra = {key: value for key, value in stats.as_dict().items()
                            if key in ("chosen_draft_lengths", "chosen_draft_lengths_by_kind", "per_position", "draft_s",
                                       "verify_s")}
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

    def run(self, prompt_ids, n_tokens, temperature, top_p, seed):
        llm = self.llm
        llm.reset()  # else generate() reuses the KV cache of the same prompt and skips the prefill
        if hasattr(llm, "set_seed"):
            llm.set_seed(seed)
        if self.counter:
            self.counter.reset()
        # generate() never stops on end-of-generation by itself; every warper but temperature and top-p is off
        stream = llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=top_p, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0, reset=True)
        result, _ = timed_stream(stream, n_tokens, len(prompt_ids))
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


class LlamaBenchEngine(Engine):
    """llama.cpp's own C++ benchmark, `llama-bench`: the peer at its best build (native, or AVX2-only to
    compare with an AVX2 build of Outrider), without llama-cpp-python's Python layer. It times prompt
    processing of as many tokens as the cell's prompt and generation of the cell's new tokens after it,
    on tokens of its own choosing: so its numbers are the same at every temperature and prompt text, and it
    has no drafter. One run is one `llama-bench -r 1` call."""

    engine = "llama-bench"
    label = "llama-bench"

    def __init__(self, model_path: str, threads: int, binary: str | None = None):
        super().__init__(model_path, threads)
        self.binary = binary or os.environ.get(LLAMA_BENCH_VARIABLE) or ""

    def load(self):
        if not self.binary:
            raise FileNotFoundError(f"no llama-bench given: pass --llama-bench PATH or set {LLAMA_BENCH_VARIABLE}")
        if not (os.path.isfile(self.binary) and os.access(self.binary, os.X_OK)):
            raise FileNotFoundError(f"{self.binary}: not an executable llama-bench")

    def run(self, prompt_ids, n_tokens, temperature, top_p, seed):
        n_prompt, n_gen = len(prompt_ids), n_tokens - 1  # the first new token counts to prefill, as for the others
        tests = self._tests(str(n_prompt), n_gen, depth=0, reps=1)
        try:
            prefill = next(t for t in tests if t["n_prompt"] == n_prompt and t["n_gen"] == 0)
            decode = next(t for t in tests if t["n_gen"] == n_gen and t["n_prompt"] == 0)
        except (StopIteration, KeyError, TypeError):
            raise OutriderError(f"llama-bench printed no prompt and generation tests for -p {n_prompt} -n {n_gen}: "
                                f"{str(tests)[:200]!r}") from None
        return RunResult(prefill_s=n_prompt / prefill["avg_ts"], decode_s=n_gen / decode["avg_ts"], n_prompt=n_prompt,
                         n_generated=n_tokens, n_first=1)

    def forward_seconds(self, ks: Iterable[int], prompt_len: int = 128, reps: int = 5) -> dict[int, float]:
        """Seconds of one k-token forward after a prompt_len-token prefix, for each k: llama-bench's
        prompt tests `-p k1,k2,... -d prompt_len` (its mean over reps), the peer's side of the cost curve."""
        ks = list(ks)
        tests = self._tests(",".join(map(str, ks)), 0, depth=prompt_len, reps=reps)
        try:
            rates = {t["n_prompt"]: t["avg_ts"] for t in tests
                     if t["n_gen"] == 0 and t.get("n_depth", prompt_len) == prompt_len}
            return {k: k / rates[k] for k in ks}
        except (KeyError, TypeError, ZeroDivisionError):
            raise OutriderError(f"llama-bench printed no prompt tests for -p {','.join(map(str, ks))} -d {prompt_len}: "
                                f"{str(tests)[:200]!r}") from None

    def _tests(self, prompts: str, n_gen: int, depth: int, reps: int) -> list:
        """llama-bench's JSON list of tests for `-p prompts -n n_gen -d depth -r reps` on this model."""
        command = [self.binary, "-m", self.model_path, "-t", str(self.threads), "-p", prompts, "-n", str(n_gen),
                   "-d", str(depth), "-r", str(reps), "-o", "json"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OutriderError(f"llama-bench exited with {done.returncode}: {last}")
        try:
            tests = json.loads(done.stdout)
        except ValueError:
            raise OutriderError(f"llama-bench printed no JSON: {done.stdout[:200]!r}") from None
        return tests if isinstance(tests, list) else []


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

    def run(self, prompt_ids, n_tokens, temperature, top_p, seed):
        streamer = _TimingStreamer()
        input_ids = torch.tensor([list(prompt_ids)])
        kwargs: dict[str, Any] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if temperature > 0:
            kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": top_p}
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
                 draft_max: int | str = "auto", llama_bench: str | None = None,
                 options: Iterable[tuple[str, str]] = ()) -> list[Engine]:
    made: list[Engine] = []
    for engine in engines:
        if engine == "outrider":
            made += [OutriderEngine(model_path, threads, d, draft_max, options) for d in drafters]
        elif engine == "llama.cpp":
            made += [LlamaCppEngine(model_path, threads, lookup) for lookup in (False, True)]
        elif engine == "llama-bench":
            made.append(LlamaBenchEngine(model_path, threads, llama_bench))
        elif engine == "transformers":
            made += [TransformersEngine(model_path, threads, lookup) for lookup in (False, True)]
        else:
            raise ConfigError(f"unknown engine '{engine}'; choose from {', '.join(ENGINES)}")
    return made
