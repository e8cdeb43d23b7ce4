"""Load on servers: N concurrent clients (the official openai client, streamed chat completions) for a bounded
time against each engine this script starts on 127.0.0.1 and stops at the end, engines one after another in
one run, each at every client count.

    python benchmarks/serve_load.py [--duration 60] [--clients 1,2,4,8] [--max-tokens 64] [--temperatures 0,0.7]
        [--model smollm2-135m] [--draft-model qwen2.5-coder-0.5b] [--threads 2]
        [--engines outrider:1:none,outrider:4:none,outrider:4:lookup,llama:4:none]
        [--disconnects 0.2] [-- more `outrider serve` arguments]

An engine is `outrider:SLOTS:DRAFTER` (`outrider serve -np SLOTS --drafter DRAFTER`; `outrider:1:...` is the one
at a time server of before) or `llama:SLOTS:none|draft` (llama-server -np SLOTS, plain or `-md DRAFT_MODEL
--spec-type draft-simple`; `$LLAMA_SERVER`, else the build of `../shared/tools/build-llama-cpp`). Every engine
gets the same files, threads and a context of 4096 a slot. Clients cycle through `outrider bench`'s three prompts
(code edit, summary, story) and the temperatures; a sampled request has a seed. Per engine and client count:
aggregate completion tokens/s, requests/s, p50/p99 latency and time to first token (as the client sees them,
queueing included), errors by kind, and the server's resident memory (after a warm-up request, at most, at the
end). `--disconnects P`: each streamed request is closed after its first chunks with probability P (a client
gone). No request starts after --duration; those in flight then run to their end (within --tail seconds more,
else they are cut and counted apart from errors), so the load stays at its client count to the end of the window,
and the aggregate counts the tokens made inside it: a request's tokens spread evenly from its first to its last
chunk, the share inside the window counted (a request cut at the window's end would otherwise lose them all, a
request run past it add those of a thinner load). Client i starts i * --stagger seconds after the first (clients
that start together measure a burst, each later one waiting for the prompts before it) and the window opens when
the last has started. Requests ask for `cache_prompt: false` (`--cache-prompt` to leave llama-server's prefix reuse
on; Outrider's server has none yet), so every engine reads every prompt. Name the CPU's vector extensions beside
the figures.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from outrider.bench import PROMPTS

HOST = "127.0.0.1"  # never anything else: this script loads a machine, it must not reach another
SLOT_CONTEXT = 4096


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class RSSPeak:
    """The most resident memory a process holds while the block runs, read every second."""

    def __init__(self, pid: int):
        self.pid, self.mib = pid, rss_mib(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            try:
                self.mib = max(self.mib, rss_mib(self.pid))
            except (OSError, RuntimeError):
                return

    def __enter__(self) -> "RSSPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def window_share(first: float, last: float, window_start: float, window_end: float) -> float:
    """The share of a request's tokens made inside the window, its tokens spread evenly from its first chunk to its
    last."""
    if last <= first:
        return float(window_start <= last <= window_end)
    inside = min(last, window_end) - max(first, window_start)
    return max(inside, 0.0) / (last - first)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def wait_until_up(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} before it was up")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not up after {timeout_s:.0f} s")


def llama_server_binary() -> str:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    tool = Path(__file__).resolve().parents[2] / "shared" / "tools" / "build-llama-cpp"
    # ggml's AMX kernels die on prompt batches in these VMs (the tool's --no-amx note): a server needs the other build
    from outrider.native import vector_extensions

    amx = "amx_int8" in vector_extensions()
    out = subprocess.run([str(tool), *(["--no-amx"] if amx else [])], capture_output=True, text=True,
                         check=True).stdout.strip()
    return str(Path(out.splitlines()[-1]) / "llama-server")


def server_command(engine: str, port: int, args) -> list[str]:
    """The command line that starts `engine` (see the module's doc) on `port`."""
    kind, slots, drafter = (engine.split(":") + ["none"])[:3]
    if kind == "outrider":
        return [sys.executable, "-m", "outrider", "serve", "--host", HOST, "--port", str(port), "--model",
                args.model, "--drafter", drafter, "-np", slots, "-c", str(SLOT_CONTEXT * int(slots)),
                "-t", str(args.threads), "--queue-size", str(max(args.clients)),
                *(["-md", args.draft_model] if drafter == "draft-model" else []),
                *[a for a in args.server_args if a != "--"]]
    if kind == "llama":
        from outrider.catalog import resolve_model

        draft = ["-md", str(resolve_model(args.draft_model)), "--spec-type", "draft-simple", "--spec-draft-threads",
                 str(args.threads)] if drafter == "draft" else []
        return [llama_server_binary(), "-m", str(resolve_model(args.model)), "-np", slots, "-c",
                str(SLOT_CONTEXT * int(slots)), "-t", str(args.threads), "-tb", str(args.threads), "--host", HOST,
                "--port", str(port), "--no-webui", "--metrics", *draft]
    raise SystemExit(f"unknown engine {engine!r}: give outrider:SLOTS:DRAFTER or llama:SLOTS:none|draft")


def load(base: str, model: str, clients: int, args, temperatures: list[float]) -> dict:
    """`clients` clients for `args.duration` seconds; what they saw."""
    import openai  # the test extra; imported late so --help works without it

    requests = itertools.count()
    lock = threading.Lock()
    latencies, ttfts, errors, cut, dropped = [], [], collections.Counter(), [0], [0]
    spans = []  # (first chunk, last chunk, completion tokens)
    started = time.perf_counter() + args.stagger * (clients - 1)  # the window opens when the last client starts
    deadline = started + args.duration  # the window's end: no request starts after it
    last_call = deadline + args.tail
    jobs = list(itertools.product(PROMPTS.values(), temperatures))

    def client_loop(index: int) -> None:
        own = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        chance = random.Random(index)
        time.sleep(index * args.stagger)
        while time.perf_counter() < deadline:
            n = next(requests)
            if n >= args.max_requests:
                return
            prompt, temperature = jobs[n % len(jobs)]
            start = time.perf_counter()
            first, completion, drop_after = None, 0, (3 if chance.random() < args.disconnects else None)
            # nothing may outlast the tail: a request still waiting for bytes then times out, one still streaming
            # is closed at its next chunk; both count as cut, not errors
            timeout = max(1.0, last_call - time.perf_counter())
            try:
                stream = own.with_options(timeout=timeout).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                    temperature=temperature, seed=n, stream=True, stream_options={"include_usage": True},
                    extra_body={"cache_prompt": args.cache_prompt})
                chunks = 0
                with stream:
                    for chunk in stream:
                        chunks += 1
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - start
                        if chunk.usage:
                            completion = chunk.usage.completion_tokens
                        if time.perf_counter() > last_call:
                            raise TimeoutError("cut at the end of the tail")
                        if drop_after is not None and chunks >= drop_after:
                            break  # a client gone: the stream is closed mid-answer
                if drop_after is not None and chunks >= drop_after:
                    with lock:
                        dropped[0] += 1
                    continue
            except Exception as exc:  # noqa: BLE001 - counted and reported, the load goes on
                with lock:
                    if time.perf_counter() > last_call:
                        cut[0] += 1
                    else:
                        errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
                continue
            end = time.perf_counter()
            with lock:
                latencies.append(end - start)
                ttfts.append(first if first is not None else latencies[-1])
                spans.append((start + ttfts[-1], end, completion))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) and time.perf_counter() < last_call + 1.0:
        time.sleep(0.2)
    elapsed = max(min(time.perf_counter(), deadline) - started, 1e-9)
    with lock:  # what the given-up threads do from here on is not counted
        cut_total = cut[0] + sum(thread.is_alive() for thread in threads)
        done_latencies, done_ttfts, done_spans = list(latencies), list(ttfts), list(spans)
        seen_errors = collections.Counter(errors)
        dropped_total = dropped[0]
    done = len(done_latencies)
    in_window = sum(n * window_share(first, last, started, deadline) for first, last, n in done_spans)
    return {"clients": clients, "duration_s": round(elapsed, 1), "requests": done,
            "requests_per_s": round(done / elapsed, 3), "completion_tokens_per_s": round(in_window / elapsed, 2),
            "latency_s": {"p50": round(percentile(done_latencies, 50), 3),
                          "p99": round(percentile(done_latencies, 99), 3)},
            "ttft_s": {"p50": round(percentile(done_ttfts, 50), 3), "p99": round(percentile(done_ttfts, 99), 3)},
            "errors": sum(seen_errors.values()), "error_kinds": dict(seen_errors), "cut_after_tail": cut_total,
            "disconnected": dropped_total}


def run_engine(engine: str, args, temperatures: list[float]) -> list[dict]:
    import openai

    port = free_port()
    base = f"http://{HOST}:{port}"
    command = server_command(engine, port, args)
    log = tempfile.NamedTemporaryFile("w+", prefix="serve-load-", suffix=".log", delete=False)
    print(f"{engine}: {' '.join(command)} (log: {log.name})", flush=True)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    reports = []
    try:
        wait_until_up(base, server, args.startup_timeout)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS["story"]}],
                                       max_tokens=args.max_tokens)  # warm-up: first-use costs are not load
        rss_start = rss_mib(server.pid)
        for clients in args.clients:
            with RSSPeak(server.pid) as peak:
                report = load(base, model, clients, args, temperatures)
            report.update(engine=engine, server_rss_mib={"after_warm_up": round(rss_start, 1), "peak": round(peak.mib, 1),
                                                         "end": round(rss_mib(server.pid), 1)})
            reports.append(report)
            print(f"  {clients} clients: {report['completion_tokens_per_s']} tok/s, {report['requests']} requests, "
                  f"latency p50/p99 {report['latency_s']['p50']}/{report['latency_s']['p99']} s, ttft p50/p99 "
                  f"{report['ttft_s']['p50']}/{report['ttft_s']['p99']} s, errors {report['errors']}"
                  f"{' ' + str(report['error_kinds']) if report['errors'] else ''}, disconnected "
                  f"{report['disconnected']}, RSS {report['server_rss_mib']['end']} MiB (peak "
                  f"{report['server_rss_mib']['peak']})", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    if not any(r["errors"] for r in reports):
        os.unlink(log.name)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per engine and client count")
    parser.add_argument("--clients", default="1,2,4,8", help="client counts, comma-separated")
    parser.add_argument("--max-requests", type=int, default=100000, help="stop starting requests after this many")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="outrider:1:lookup,outrider:4:lookup")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--disconnects", type=float, default=0.0, help="share of requests closed mid-stream")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds between the clients' starts")
    parser.add_argument("--cache-prompt", action="store_true", help="let llama-server reuse a slot's prompt prefix")
    parser.add_argument("--tail", type=float, default=180.0, help="seconds past --duration the requests in flight "
                        "may take to end")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="model load and kernel build")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --: more `outrider serve` arguments, e.g. -- -o backend.weights dense")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    reports = [r for engine in args.engines.split(",") for r in run_engine(engine.strip(), args, temperatures)]
    print(f"\naggregate completion tokens/s ({args.model}, temperatures {args.temperatures}, {args.max_tokens} "
          f"tokens a request, {args.duration:g} s a cell)")
    print("engine".ljust(28) + "".join(f"{c} clients".rjust(12) for c in args.clients))
    for engine in dict.fromkeys(r["engine"] for r in reports):
        row = {r["clients"]: r["completion_tokens_per_s"] for r in reports if r["engine"] == engine}
        print(engine.ljust(28) + "".join(f"{row.get(c, float('nan')):12.2f}" for c in args.clients))
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
