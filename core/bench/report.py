"""The bench's outputs: a markdown table per model, the JSON of every run, and a PNG chart."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from outrider.bench.results import PAIRED_COLUMNS
from outrider.bench.run import Sampling


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _sampling(cell: dict) -> str:
    """The T column: `0.7`, or `0.7@0.95` for a top-p cell (reports before top-p cells have no top_p)."""
    return str(Sampling(cell["temperature"], cell.get("top_p", 1.0)))


def markdown(report: dict[str, Any]) -> str:
    lines = []
    s = report["settings"]
    bandwidth = report["machine"].get("read_bandwidth_gbs")
    lines.append(f"{s['tokens']} new tokens per run (end-of-generation ignored), median of {s['runs']} runs after "
                 f"a warm-up round, {s['threads']} threads, draft length {s['draft_max']}; decode tok/s = tokens "
                 "after the first / time after the first; prefill tok/s = prompt tokens / time to the first "
                 "token. Each run runs every configuration back to back; a ratio (vs ...) is the median over runs "
                 "of the ratio within a run, which the machine's drift from run to run does not move."
                 + (" T@p is temperature T with top-p p (0.7@0.95 is what chat front-ends send)."
                    if any("@" in _sampling(c) for e in report["models"].values() for c in e["cells"]) else ""))
    machine = report["machine"]
    if "vector_extensions" in machine:  # which kernels ran: name them beside every figure
        lines.append(f"CPU vector extensions: {' '.join(machine['vector_extensions']) or 'none of note'}; "
                     f"Outrider's kernels built with {' '.join(machine.get('kernel_cflags', []))}.")
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
            lines.append(f"| {c['prompt']} | {_sampling(c)} | {c['config']} | "
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
                lines.append(f"| {c['prompt']} | {_sampling(c)} | {c['config']} | "
                             + " | ".join(_fmt(c["paired"][key], ".2f", "x") for key in PAIRED_COLUMNS) + " |")
        by_kind = [(c, kinds) for c in entry["cells"] for kinds in [_lengths_by_kind(c)] if len(kinds) > 1]
        if by_kind:
            lines.append("")
            lines.append("Draft lengths `--draft-max auto` chose, per kind of draft (each kind has its own acceptance "
                         "and cost), over all runs: length x rounds:")
            lines.append("")
            lines.append("| prompt | T | engine | kind | lengths chosen |")
            lines.append("|---|---|---|---|---|")
            for c, kinds in by_kind:
                for kind, hist in kinds.items():
                    shown = ", ".join(f"{k}x{n}" for k, n in sorted(hist.items(), key=lambda kv: int(kv[0])))
                    lines.append(f"| {c['prompt']} | {_sampling(c)} | {c['config']} | {kind} | {shown} |")
        if entry.get("forward_cost_curve"):
            lines.append("")
            setup = entry.get("forward_cost_setup", {"prefix": 128, "reps": 5})  # the earlier reports' setup
            prefix, reps = setup["prefix"], setup["reps"]
            lines.append(f"Cost of a k-token forward after a {prefix}-token prefix, relative to a 1-token forward, "
                         f"and its time (Outrider: every row's logits, median of {reps}; llama-bench: `-p k -d "
                         f"{prefix}`, a prompt, so its last row's logits only, the cheaper job, mean of {reps}):")
            lines.append("")
            curve = entry["forward_cost_curve"]
            lines.append("| k | " + " | ".join(curve) + " |")
            lines.append("|---|" + "---|" * len(curve))
            lines.append("| Outrider cost | " + " | ".join(f"{v:.2f}" for v in curve.values()) + " |")
            if entry.get("forward_ms"):
                lines.append("| Outrider ms | " + " | ".join(f"{v:.2f}" for v in entry["forward_ms"].values()) + " |")
            for label, theirs in (entry.get("peer_forward_cost_curve") or {}).items():
                ms = (entry.get("peer_forward_ms") or {}).get(label, {})
                lines.append(f"| {label} cost | " + " | ".join(f"{theirs[k]:.2f}" if k in theirs else "-"
                                                           for k in curve) + " |")
                lines.append(f"| {label} ms | " + " | ".join(f"{ms[k]:.2f}" if k in ms else "-" for k in curve) + " |")
    if report["notes"]:
        lines.append("")
        lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _lengths_by_kind(cell: dict) -> dict[str, dict[str, int]]:
    """The draft lengths chosen per kind of draft, summed over a cell's runs (from the runs' extra)."""
    total: dict[str, dict[str, int]] = {}
    for run in cell.get("runs", []):
        for kind, hist in ((run.get("extra") or {}).get("chosen_draft_lengths_by_kind") or {}).items():
            for length, n in hist.items():
                total.setdefault(kind, {})[str(length)] = total.get(kind, {}).get(str(length), 0) + int(n)
    return total


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
        groups = list(dict.fromkeys((c["prompt"], _sampling(c)) for c in entry["cells"]))
        configs = list(dict.fromkeys(c["config"] for c in entry["cells"]))
        values = {(c["prompt"], _sampling(c), c["config"]): c["median"]["decode_tokens_per_s"]
                  for c in entry["cells"]}
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            xs = [g + (i - (len(configs) - 1) / 2) * width for g in range(len(groups))]
            ys = [values.get((p, t, config)) or 0.0 for p, t in groups]
            ax.bar(xs, ys, width, label=config)
        if entry.get("bound_stored_tokens_per_s"):
            ax.axhline(entry["bound_stored_tokens_per_s"], color="gray", linestyle="--", linewidth=1,
                       label="bandwidth bound (GGUF size)")
        ax.set_xticks(range(len(groups)), [f"{p}, T={t}" for p, t in groups])
        ax.set_ylabel("decode tok/s (median)")
        ax.set_title(f"{model}: {report['settings']['tokens']} tokens, {report['settings']['threads']} threads")
        ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

