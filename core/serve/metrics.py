"""``/metrics`` for ``graphrt serve``: Prometheus text, vLLM's metric names under
``graphrt:``.

Per request (``RequestTimer``, fed from the engine loop's events): prompt and generated
tokens, requests by finish reason, time to first token, inter-token latency and
end-to-end latency histograms. Read from the engine at scrape time
(``_EngineCollector``): running and waiting requests, KV-cache usage, and speculative
decoding's drafts, draft tokens and accepted tokens, in total and per draft position
(vLLM's ``spec_decode_num_accepted_tokens_per_pos``), and the mean accept length
(SGLang's ``spec_accept_length``).
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from graphrt.core.serve.llm import LLM, Completion

# Seconds. First tokens on a CPU run take up to seconds (prefill, a first compile);
# steps on an H200 take milliseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20)
ITL_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)


class ServerMetrics:
    def __init__(self, llm: LLM, model_name: str) -> None:
        disable_created_metrics()  # no `_created` series beside each counter (as vLLM)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("graphrt:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("graphrt:generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "graphrt:request_success", "Requests finished, by finish reason.", ["finished_reason"]
        )
        self.requests_refused = counter(
            "graphrt:requests_refused", "Requests refused before running, by status.", ["status"]
        )
        self.ttft = histogram(
            "graphrt:time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "graphrt:inter_token_latency_seconds",
            "Between a request's tokens after its first (a step's tokens share its time).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "graphrt:e2e_request_latency_seconds",
            "From a request's arrival to its end.",
            E2E_BUCKETS,
        )
        self.registry.register(_EngineCollector(llm, model_name))

    def refused(self, status: int) -> None:
        self.requests_refused.labels(self.model_name, str(status)).inc()

    def timer(self, arrived: float) -> RequestTimer:
        return RequestTimer(self, arrived)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's token counts and times (``time.perf_counter`` seconds)."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self.m = metrics
        self.arrived = arrived
        self.tokens = 0
        self.last = arrived

    def admitted(self, prompt_tokens: int) -> None:
        self.m.prompt_tokens.labels(self.m.model_name).inc(prompt_tokens)

    def update(self, new: int, done: Completion | None) -> None:
        """After a step: ``new`` tokens it generated; ``done`` once it has finished."""
        now, name = time.perf_counter(), self.m.model_name
        if new > 0:
            if self.tokens == 0:  # a first round's further tokens: no gap of their own
                self.m.ttft.labels(name).observe(now - self.arrived)
            else:  # a round's tokens share its time: each counts its share
                for _ in range(new):
                    self.m.itl.labels(name).observe((now - self.last) / new)
            self.m.generation_tokens.labels(name).inc(new)
            self.tokens, self.last = self.tokens + new, now
        if done is not None:
            self.m.e2e.labels(name).observe(now - self.arrived)
            self.m.request_success.labels(name, done.finish_reason).inc()


class _EngineCollector:
    """What the engine holds now, read under its step lock at scrape time."""

    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self):
        engine, name = self.llm.engine, self.model_name
        with self.llm.step_lock:
            running, waiting = len(engine.running), len(engine.waiting)
            pool = engine.kv_pool
            used = 1.0 - pool.available() / pool.num_slots
            stats = engine.stats
            drafted = list(stats.drafted_per_position)
            accepted = list(stats.accepted_per_position)
            rounds, accept_length = stats.spec_rounds, stats.accept_length_mean

        def gauge(metric, doc, value):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric, doc, value):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("graphrt:num_requests_running", "Requests in the running batch.", running)
        yield gauge("graphrt:num_requests_waiting", "Requests waiting for KV room.", waiting)
        yield gauge("graphrt:kv_cache_usage_perc", "KV slots in use (1 = full).", used)
        yield gauge("graphrt:kv_cache_tokens", "KV slots in the pool.", pool.num_slots)
        yield counter("graphrt:spec_decode_num_drafts", "Speculative rounds verified.", rounds)
        yield counter(
            "graphrt:spec_decode_num_draft_tokens", "Draft tokens verified.", sum(drafted)
        )
        yield counter(
            "graphrt:spec_decode_num_accepted_tokens", "Draft tokens accepted.", sum(accepted)
        )
        per_pos = CounterMetricFamily(
            "graphrt:spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose draft token at this position (0 first) was accepted.",
            labels=["model_name", "position"],
        )
        for position, n in enumerate(accepted):
            per_pos.add_metric([name, str(position)], n)
        yield per_pos
        yield gauge(
            "graphrt:spec_accept_length",
            "Mean tokens a speculative round emits (accepted drafts plus one).",
            accept_length,
        )
