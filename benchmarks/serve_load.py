"""Load on `outrider serve`: N concurrent clients (the official openai client, streamed chat completions)
for a bounded time against a server this script starts on 127.0.0.1 and stops at the end.

    python benchmarks/serve_load.py [--duration 120] [--clients 8] [--max-requests 5000] [--max-tokens 64]
                                    [--model smollm2-135m] [--drafter lookup] [--temperatures 0,0.7]
                                    [-- more `outrider serve` arguments]

Clients cycle through `outrider bench`'s three prompts (code edit, summary, story) and the temperatures;
a sampled request has a seed. Prints requests/s, p50/p99 latency and time to first token (both as the
client sees them: queueing included, since one generation runs at a time), errors by kind, the acceptance
the server's /metrics counted, and the server's resident memory after a warm-up request and at the end.
No request starts after --duration or --max-requests; those still in flight a moment after --duration are cut
(closed, or given up on and closed when the server stops) and counted apart from errors, so the run ends on time.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from outrider.bench import PROMPTS

HOST = "127.0.0.1"  # never anything else: this script loads a machine, it must not reach another
CUT_GRACE_S = 2.0


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


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.keys()
            - {"model_name"}}


def wait_until_up(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} before it was up")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not up after {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load [120]")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=5000, help="stop starting requests after this many")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="lookup")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="model load and kernel build")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --: more `outrider serve` arguments, e.g. -- -o backend.weights dense")
    args = parser.parse_args()
    import openai  # the test extra; imported late so --help works without it

    temperatures = [float(t) for t in args.temperatures.split(",")]
    port = free_port()
    base = f"http://{HOST}:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="outrider-serve-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "outrider", "serve", "--host", HOST, "--port", str(port), "--model", args.model,
               "--drafter", args.drafter, "--queue-size", str(args.clients),
               *[a for a in args.server_args if a != "--"]]
    print("server:", " ".join(command[1:]), f"(log: {log.name})", flush=True)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(base, server, args.startup_timeout)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS["story"]}],
                                       max_tokens=args.max_tokens)  # warm-up: first-use costs are not load
        rss_start = rss_mib(server.pid)
        before = counters(base)

        requests = itertools.count()
        lock = threading.Lock()
        latencies, ttfts, tokens, errors, cut = [], [], [], collections.Counter(), [0]
        deadline = time.monotonic() + args.duration
        jobs = list(itertools.product(PROMPTS.values(), temperatures))

        def client_loop(index: int) -> None:
            own = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
            while time.monotonic() < deadline:
                n = next(requests)
                if n >= args.max_requests:
                    return
                prompt, temperature = jobs[n % len(jobs)]
                start = time.perf_counter()
                first, completion = None, 0
                # nothing may outlast the deadline by more than a moment: a request still waiting for bytes
                # then times out, one still streaming is closed at its next chunk; both count as cut, not errors
                timeout = max(1.0, deadline - time.monotonic() + CUT_GRACE_S)
                try:
                    stream = own.with_options(timeout=timeout).chat.completions.create(
                        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                        temperature=temperature, seed=n, stream=True, stream_options={"include_usage": True})
                    with stream:
                        for chunk in stream:
                            if first is None and chunk.choices and chunk.choices[0].delta.content:
                                first = time.perf_counter() - start
                            if chunk.usage:
                                completion = chunk.usage.completion_tokens
                            if time.monotonic() > deadline + CUT_GRACE_S:
                                raise TimeoutError("cut at the deadline")
                except Exception as exc:  # noqa: BLE001 - counted and reported, the load goes on
                    with lock:
                        if time.monotonic() > deadline:
                            cut[0] += 1
                        else:
                            errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)
                    ttfts.append(first if first is not None else latencies[-1])
                    tokens.append(completion)

        started = time.perf_counter()
        rss_samples = [rss_start]
        # daemon threads: one still waiting at the deadline is given up on, not waited for (its read timeout
        # counts from its last byte, which may be long before the deadline when the server was busy)
        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline + CUT_GRACE_S:
            time.sleep(0.5)
            rss_samples.append(rss_mib(server.pid))
        elapsed = time.perf_counter() - started
        with lock:  # what the given-up threads do from here on is not counted
            cut_total = cut[0] + sum(thread.is_alive() for thread in threads)
            # copies under other names: the threads' closures would see a rebinding of these
            done_latencies, done_ttfts, done_tokens = list(latencies), list(ttfts), list(tokens)
            seen_errors = collections.Counter(errors)
        rss_end = rss_mib(server.pid)
        after = counters(base)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    done = len(done_latencies)
    drafted, accepted = delta("outrider:spec_decode_num_draft_tokens_total"), \
        delta("outrider:spec_decode_num_accepted_tokens_total")
    report = {
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": done,
        "requests_per_s": round(done / elapsed, 3), "completion_tokens_per_s": round(sum(done_tokens) / elapsed, 1),
        "latency_s": {"p50": round(percentile(done_latencies, 50), 3), "p99": round(percentile(done_latencies, 99), 3)},
        "ttft_s": {"p50": round(percentile(done_ttfts, 50), 3), "p99": round(percentile(done_ttfts, 99), 3)},
        "errors": sum(seen_errors.values()), "error_kinds": dict(seen_errors), "cut_at_deadline": cut_total,
        "acceptance": {"drafted": drafted, "accepted": accepted,
                       "rate": round(accepted / drafted, 3) if drafted else 0.0},
        "server_rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1), "max": round(max(rss_samples), 1)},
    }
    print(f"{done} requests from {args.clients} clients in {elapsed:.1f} s: {report['requests_per_s']} requests/s, "
          f"{report['completion_tokens_per_s']} completion tokens/s")
    print(f"latency p50 {report['latency_s']['p50']} s, p99 {report['latency_s']['p99']} s; "
          f"time to first token p50 {report['ttft_s']['p50']} s, p99 {report['ttft_s']['p99']} s")
    print(f"errors: {report['errors']} {dict(seen_errors) if seen_errors else ''}; requests in flight at the deadline, "
          f"cut: {cut_total}")
    print(f"acceptance: {accepted:.0f}/{drafted:.0f} drafted tokens ({report['acceptance']['rate']:.0%})")
    print(f"server RSS: {rss_start:.1f} MiB after warm-up, {rss_end:.1f} MiB at the end, "
          f"{max(rss_samples):.1f} MiB at most")
    print(json.dumps(report))
    if seen_errors:
        print(f"server log kept: {log.name}")
    else:
        os.unlink(log.name)


if __name__ == "__main__":
    main()
