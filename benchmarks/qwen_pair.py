"""Speculative decoding on a real target/draft pair, Outrider beside llama-server, in one run.

The pair is the catalog's Qwen2.5-Coder 1.5B (target) with its 0.5B (draft), both Q4_K_M. Every engine gets
the same prompt text (the file's chat template, rendered by Outrider), greedy decoding (`--temperature T`:
sampled, top-k 40, top-p 0.95, a seed per run; Outrider adds `draft-model -o drafter.sample true`), the same threads and
at most --tokens new tokens; decode speed is new tokens / decode seconds as each engine reports it (Outrider's
stats, llama-server's `timings.predicted_per_second`), prefill excluded on both sides. Medians over --runs,
the configurations of one engine interleaved run by run.

    python benchmarks/qwen_pair.py --threads 2 --runs 3
    LLAMA_SERVER=/path/to/llama-server python benchmarks/qwen_pair.py --engines outrider,llama.cpp

The AVX2 path on an AVX-512 machine: `OUTRIDER_NATIVE_MARCH=x86-64-v3` for Outrider's kernels and
`LLAMA_SERVER=` the `build-llama-cpp --avx2` build's llama-server.

llama-server: `$LLAMA_SERVER`, else the build of `../shared/tools/build-llama-cpp --no-amx` (on an AMX
Xeon the native build's AMX kernels die on prompt batches in these VMs). Its configurations: plain, `-md`
with its defaults (`--spec-draft-n-max 3`), `-md --spec-draft-n-max 8 --spec-draft-p-min 0.75`, and
`--spec-type ngram-simple`. In this llama.cpp `-md` alone loads the draft model but drafts nothing (its
speculative types default to `none`): the `-md` configurations add `--spec-type draft-simple`, which the
server's statistics (`draft_n`) show drafting.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = {
    "code edit": (
        "Rename the function `mean` to `average` and the variable `values` to `numbers` everywhere in this code, "
        "and return the whole code:\n\n"
        "```python\nimport math\n\n\ndef mean(values):\n    if not values:\n        raise ValueError(\"empty\")\n"
        "    total = 0.0\n    for value in values:\n        total += value\n    return total / len(values)\n\n\n"
        "def variance(values):\n    m = mean(values)\n    return sum((value - m) ** 2 for value in values) / len(values)\n\n\n"
        "def stdev(values):\n    return math.sqrt(variance(values))\n\n\n"
        "def summary(values):\n    return {\"mean\": mean(values), \"stdev\": stdev(values), \"n\": len(values)}\n```"),
    "code from description": (
        "Write a Python function `merge_intervals(intervals)` that takes a list of (start, end) pairs and returns "
        "the list of merged, non-overlapping intervals sorted by start. Include a docstring and type hints."),
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
LLAMA_CONFIGS = {
    "plain": [],
    "-md (n-max 3)": ["-md", "{draft}", "--spec-type", "draft-simple"],
    "-md n-max 8 p-min 0.75": ["-md", "{draft}", "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                               "--spec-draft-p-min", "0.75"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
}
OUTRIDER_CONFIGS = ("none", "draft-model", "lookup,draft-model")
SAMPLED_CONFIG = "draft-model -o drafter.sample true"  # at T > 0: drafts drawn from q, the full-q rule
TOP_K, TOP_P = 40, 0.95  # at T > 0, both engines (llama-server's min_p is turned off)


def llama_cpp_binary(name: str, variable: str) -> Path:
    """llama.cpp's tool `name`: `$variable`, else the one `../shared/tools/build-llama-cpp --no-amx` builds."""
    if os.environ.get(variable):
        return Path(os.environ[variable])
    tool = Path(__file__).resolve().parents[2] / "shared" / "tools" / "build-llama-cpp"
    out = subprocess.run([str(tool), "--no-amx"], capture_output=True, text=True, check=True).stdout.strip()
    return Path(out.splitlines()[-1]) / name


def llama_server_binary() -> Path:
    return llama_cpp_binary("llama-server", "LLAMA_SERVER")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: Path, target: Path, draft: Path, extra: list[str], threads: int):
        self.port = _free_port()
        args = [a.format(draft=draft) for a in extra]
        if "-md" in args:
            args += ["--spec-draft-threads", str(threads)]
        cmd = [str(binary), "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *args]
        self.log = open(f"/tmp/llama-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server did not start: see {self.log.name}")

    def decode(self, prompt: str, tokens: int, temperature: float = 0.0, seed: int = 1, top_k: int = TOP_K,
               top_p: float = TOP_P, min_p: float = 0.0, ignore_eos: bool = False) -> tuple[float, int, float]:
        """(decode tok/s, new tokens, acceptance of drafts or nan)."""
        body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": temperature, "top_k": top_k,
                           "top_p": top_p, "min_p": min_p, "cache_prompt": False, "seed": seed,
                           "ignore_eos": ignore_eos}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.load(r)
        t = out["timings"]
        drafted = t.get("draft_n", 0)
        return t["predicted_per_second"], t["predicted_n"], (t.get("draft_n_accepted", 0) / drafted if drafted
                                                             else float("nan"))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def cpu_target(path: Path, threads: int):
    """The target at `path` on the CPU backend with `threads` threads, with its tokenizer (every benchmark here)."""
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.plugins.backends.cpu import CPUBackend
    from outrider.spec.drafter import Target

    g = GGUFFile(path)
    backend = CPUBackend(threads=threads)
    return Target(backend.load_model(g), Tokenizer.from_gguf(g), g, backend)


def outrider_runs(target_path: Path, draft_path: Path, prompts: dict[str, str], tokens: int, runs: int,
                  threads: int, draft_max: str, temperature: float) -> dict:
    from outrider.plugins.acceptors.greedy import GreedyAcceptor
    from outrider.plugins.acceptors.sampled import SampledAcceptor
    from outrider.plugins.drafters.draft_model import DraftModelDrafter
    from outrider.plugins.drafters.lookup import LookupDrafter
    from outrider.plugins.drafters.none import NoDrafter
    from outrider.spec.chain import DrafterChain
    from outrider.spec.drafter_traits import DrafterTraits
    from outrider.spec.runner import Runner
    from outrider.spec.sampling import SamplingParams

    target = cpu_target(target_path, threads)
    draft = DraftModelDrafter(model=str(draft_path))
    draft.setup(target)
    lookup = LookupDrafter()
    lookup.setup(target)
    drafters = {"none": NoDrafter(), "draft-model": draft,
                "lookup,draft-model": DrafterChain([lookup, draft], ["lookup", "draft-model"])}
    if temperature > 0:
        drafters[SAMPLED_CONFIG] = DraftModelDrafter(model=str(draft_path), sample=True)
        drafters[SAMPLED_CONFIG].setup(target)
    acceptor = SampledAcceptor if temperature > 0 else GreedyAcceptor
    runners = {name: Runner(target, drafter, acceptor(),
                            DrafterTraits.of(drafter, draft_max=0 if name == "none" else draft_max), context=4096)
               for name, drafter in drafters.items()}
    results = {}
    for label, text in prompts.items():
        ids = target.tokenizer.encode(text)
        for run in range(runs + 1):  # the first is a warm-up
            for name, runner in runners.items():
                params = SamplingParams(temperature, TOP_K, TOP_P, seed=1 + run) if temperature > 0 else SamplingParams()
                list(runner.generate(ids, tokens, params, stop_ids=target.tokenizer.eog_ids))
                s = runner.stats.as_dict()
                if run:
                    results.setdefault((label, name), []).append(
                        (s["decode_tokens_per_s"], s["generated_tokens"], s["acceptance_rate"] if s["drafted"] else float("nan")))
    return results


def llama_runs(binary: Path, target_path: Path, draft_path: Path, prompts: dict[str, str], tokens: int, runs: int,
               threads: int, configs: list[str], temperature: float) -> dict:
    results = {}
    for name in configs:
        server = LlamaServer(binary, target_path, draft_path, LLAMA_CONFIGS[name], threads)
        try:
            for label, text in prompts.items():
                server.decode(text, 16)  # warm-up
                for run in range(runs):
                    results.setdefault((label, name), []).append(server.decode(text, tokens, temperature, 1 + run))
        finally:
            server.close()
    return results


def median(rows: list[tuple]) -> tuple[float, int, float]:
    speeds = [r[0] for r in rows]
    accepted = [r[2] for r in rows if r[2] == r[2]]
    return statistics.median(speeds), int(statistics.median(r[1] for r in rows)), (
        statistics.median(accepted) if accepted else float("nan"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help=f"0: greedy; above: sampled with top-k {TOP_K}, top-p {TOP_P}, a seed per run")
    parser.add_argument("--engines", default="outrider,llama.cpp")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--llama-configs", default=",".join(LLAMA_CONFIGS))
    args = parser.parse_args(argv)

    from outrider.catalog import resolve_model
    from outrider.io.chat import apply_chat_template
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer
    from outrider.native import cflags, vector_extensions

    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    g = GGUFFile(target_path)
    tokenizer = Tokenizer.from_gguf(g)
    prompts = {label: apply_chat_template(g, tokenizer, [{"role": "user", "content": PROMPTS[label]}])
               for label in args.prompts.split(",")}
    engines = args.engines.split(",")
    results = {}
    server = llama_server_binary() if "llama.cpp" in engines else None
    if server:
        results["llama.cpp"] = llama_runs(server, target_path, draft_path, prompts, args.tokens,
                                          args.runs, args.threads, args.llama_configs.split(","), args.temperature)
    if "outrider" in engines:
        results["outrider"] = outrider_runs(target_path, draft_path, prompts, args.tokens, args.runs, args.threads,
                                            args.draft_max, args.temperature)
    print(f"CPU vector extensions: {' '.join(vector_extensions())}; Outrider's kernels built with "
          f"{' '.join(cflags())}; llama-server: {server or 'not run'}; "
          f"{args.threads} threads; "
          f"{'greedy' if not args.temperature else f'T={args.temperature}, top-k {TOP_K}, top-p {TOP_P}'}; {args.tokens} tokens; medians of {args.runs}; draft-max "
          f"{args.draft_max} (Outrider)\n")
    print("| prompt | engine | configuration | decode tok/s | vs own plain | vs llama.cpp plain | tokens | "
          "accepted |")
    print("|---|---|---|---|---|---|---|---|")
    for label in prompts:
        peer_plain = median(results["llama.cpp"][label, "plain"])[0] if "llama.cpp" in results else None
        for engine, runs in results.items():
            own_plain = median(runs[label, "none" if engine == "outrider" else "plain"])[0]
            for (prompt, name), rows in runs.items():
                if prompt != label:
                    continue
                speed, n, acc = median(rows)
                vs_peer = f"{speed / peer_plain:.2f}x" if peer_plain else ""
                print(f"| {label} | {engine} | {name} | {speed:.1f} | {speed / own_plain:.2f}x | {vs_peer} | {n} | "
                      f"{'' if acc != acc else f'{acc:.0%}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
