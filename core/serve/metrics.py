"""Prometheus metrics of the server, named after vLLM's with the prefix `outrider:` instead of `vllm:`.

vLLM's names, so its dashboards and users' queries carry over by swapping the prefix; not vLLM's exact
names, so a scraper that sees both engines never mixes their series. Definitions follow vLLM's:
num_drafts counts verify rounds that drafted at least one token, num_accepted_tokens_per_pos{position=j}
counts rounds that accepted draft position j (0-based). Spec-decode and token counters are added when a
generation ends (also when it was cut short by a disconnect: that work was done). Counters are exposed
with prometheus_client's `_total` suffix, as vLLM's are. Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from outrider.spec.runner import GenerationStats

PREFIX = "outrider:"
# vLLM's buckets for these two histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ITERATION_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)  # vLLM's iteration_tokens_total, shorter


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_drafts = counter("spec_decode_num_drafts", "Verify rounds that drafted at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds that accepted the drafted token at this position (0-based).",
                                        ["position"])
        self.request_success = counter("request_success", "Finished requests, by finish reason "
                                       "(stop, length, abort = client went away, error).", ["finished_reason"])
        self.requests_rejected = counter("requests_rejected", "Requests answered 503 because the queue was full.")
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to end.",
                                     labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first generated token.",
                              labels, buckets=TTFT_BUCKETS, registry=registry)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time spent waiting in the queue.",
                                    labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting in the queue.", labels,
                             registry=registry)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in a slot (prefilling or generating).",
                             labels, registry=registry)
        self.batch_size = Histogram(PREFIX + "batch_size", "Sequences one verify forward stepped together.", labels,
                                    buckets=BATCH_BUCKETS, registry=registry)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Rows one target forward read (a "
                                          "prompt chunk's, or a step's t0 and drafts over its sequences).", labels,
                                          buckets=ITERATION_BUCKETS, registry=registry)

    def record_generation(self, stats: GenerationStats, finished_reason: str) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.generation_tokens.labels(m).inc(stats.generated_tokens)
        self.num_drafts.labels(m).inc(stats.drafted_at[0] if stats.drafted_at else 0)
        self.num_draft_tokens.labels(m).inc(stats.drafted)
        self.num_accepted_tokens.labels(m).inc(stats.accepted)
        for position, count in enumerate(stats.accepted_at):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        self.request_success.labels(m, finished_reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
