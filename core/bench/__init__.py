"""`outrider bench`: Outrider beside its peers, in one run, on the same GGUF files, threads and prompt tokens.

The package by job: `prompts` (the texts and the token ids every engine gets), `engines` (one adapter per
engine configuration), `results` (what a run measured, medians, paired ratios), `costs` (the bandwidth bound
and the forward cost curve, of one sequence and of a ragged batch), `run` (settings and the interleaved rounds), `report` (table, JSON, chart).

Engines (each a small adapter with the same interface: `load()`, then `run(prompt_ids, n_tokens,
temperature, top_p, seed) -> RunResult`):

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

A cell is a prompt, a sampling setting and an engine configuration. Sampling settings are greedy (T=0),
T=0.7, and T=0.7 with top-p 0.95 (`0.7@0.95`: what chat front-ends send); every other warper is off.

Cells run interleaved: every configuration once per round, a warm-up round first, then `runs` rounds, so
slow drifts of a shared machine hit all configurations alike; the report gives medians, and ratios as the
median over rounds of the ratio within a round (`paired_ratio`).
"""

from outrider.bench.costs import (
    forward_cost_curve,
    forward_seconds,
    median_seconds,
    ragged_forward_seconds,
    read_bandwidth_gbs,
    relative_costs,
    stored_weight_bytes,
    tensor_bytes,
)
from outrider.bench.engines import (
    DRAFTERS,
    ENGINES,
    Engine,
    LlamaBenchEngine,
    LlamaCppEngine,
    OutriderEngine,
    TransformersEngine,
    make_engines,
)
from outrider.bench.prompts import PROMPTS, prompt_ids
from outrider.bench.report import draw_chart, markdown, write_json
from outrider.bench.results import RunResult, median, medians, paired_ratio
from outrider.bench.run import DEFAULT_MODELS, DEFAULT_SAMPLINGS, BenchSettings, Sampling, run_bench

__all__ = ["BenchSettings", "DEFAULT_MODELS", "DEFAULT_SAMPLINGS", "DRAFTERS", "ENGINES", "Engine", "LlamaBenchEngine",
           "LlamaCppEngine", "OutriderEngine", "PROMPTS", "RunResult", "Sampling", "TransformersEngine", "draw_chart",
           "forward_cost_curve", "forward_seconds", "make_engines", "markdown", "median", "median_seconds", "medians", "paired_ratio",
           "prompt_ids", "ragged_forward_seconds", "read_bandwidth_gbs", "relative_costs", "run_bench", "stored_weight_bytes", "tensor_bytes",
           "write_json"]
