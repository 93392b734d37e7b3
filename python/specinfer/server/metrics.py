"""Prometheus metrics (`GET /metrics`, text format), one CollectorRegistry per app.

Measured in the server, per choice (one engine request; a request with n=2 counts twice), from
the moment the HTTP request arrived:

    specinfer:time_to_first_token_seconds   histogram: arrival -> first output carrying a token
    specinfer:inter_token_latency_seconds   histogram: an output carrying k tokens, t after the
                                            previous one, observes t / k, k times (speculation
                                            emits several tokens a step)
    specinfer:e2e_request_latency_seconds   histogram: arrival -> finished output
    specinfer:requests_finished_total       counter, label finished_reason: stop | length |
                                            abort (client gone, shutdown) | error
    specinfer:http_requests_total           counter, labels method, route (the route's
                                            template; "unmatched" where no route took it: an
                                            unknown path, or a key check's 401) and status:
                                            every HTTP request answered, refused ones included

Read from `engine.stats()` at every scrape (`EngineCollector`; absent while the engine loads):

    specinfer:num_requests_running          gauge = running
    specinfer:num_requests_waiting          gauge = waiting
    specinfer:kv_cache_usage_perc           gauge = kv_used_tokens / kv_capacity_tokens (a
                                            fraction in [0, 1], as vLLM's of that name)
    specinfer:num_preemptions_total         counter = preemptions_total
    specinfer:prefix_cache_queries_total    counter = prefix_cache_queries_total (tokens a
                                            prefill looked up in the prefix cache)
    specinfer:prefix_cache_hits_total       counter = prefix_cache_hits_total (of those, found:
                                            not prefilled; hit rate in PromQL, as vLLM's)
    specinfer:prompt_tokens_total           counter = prompt_tokens_total
    specinfer:generation_tokens_total       counter = generation_tokens_total
    specinfer:spec_decode_num_drafts_total  counter = spec_drafts_total (verification steps of
                                            requests: a step over a batch of b counts b)
    specinfer:spec_decode_num_draft_tokens_total     counter = spec_draft_tokens_total (tree
                                            nodes verified, roots excluded)
    specinfer:spec_decode_num_accepted_tokens_total  counter = spec_accepted_tokens_total
    specinfer:spec_decode_num_accepted_tokens_per_pos_total  counter, label position p (0-based)
                                            = spec_accepted_per_depth[p] (accepted at depth p+1)
    specinfer:spec_decode_mean_tokens_per_step       gauge = spec_emitted_tokens_total /
                                            spec_steps_total (0 before the first step)
    specinfer:spec_decode_draft_acceptance_rate      gauge = spec_accepted_tokens_total /
                                            spec_draft_tokens_total (0 before any draft; tree
                                            siblings count as drafts, so it is lower than a
                                            chain's acceptance rate)

vLLM's mean acceptance length is 1 + num_accepted_tokens / num_drafts (rates in PromQL).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "specinfer:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict | None]):
        """stats: returns engine.stats(), or None while there is no engine."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Latency per output token after "
                             "the first", buckets=_ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=_E2E_BUCKETS, registry=r)  # fmt: skip
        self.finished = Counter(P + "requests_finished", "Requests finished, by reason",
                                ["finished_reason"], registry=r)  # fmt: skip
        self.http = Counter(P + "http_requests", "HTTP requests answered, by method, route "
                            "and status", ["method", "route", "status"], registry=r)  # fmt: skip
        r.register(EngineCollector(stats))

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)


class RequestTimer:
    """The latencies of one choice; `arrival` is time.perf_counter() when the request came."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None
        self.reason: str | None = None

    def output(self, out) -> None:
        now, k = time.perf_counter(), len(out.token_ids)
        if k:
            if self.last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                for _ in range(k):
                    self.metrics.itl.observe((now - self.last) / k)
            self.last = now
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)
            self.reason = out.finish_reason or "stop"

    def close(self, error: bool = False) -> None:
        """The choice is over: count it by its finish reason (abort if it never finished)."""
        reason = self.reason or ("error" if error else "abort")
        self.metrics.finished.labels(finished_reason=reason).inc()


class EngineCollector:
    """Engine counters and gauges, read from engine.stats() at each scrape."""

    def __init__(self, stats: Callable[[], dict | None]):
        self.stats = stats

    def describe(self):
        return []  # metrics appear once the engine is there; nothing to check at registration

    def collect(self):
        s = self.stats()
        if s is None:
            return
        yield _gauge("num_requests_running", "Requests in the running batch", s["running"])
        yield _gauge("num_requests_waiting", "Requests waiting to be admitted", s["waiting"])
        cap = s["kv_capacity_tokens"]
        yield _gauge("kv_cache_usage_perc", "KV cache usage (fraction of token slots in use)",
                     s["kv_used_tokens"] / cap if cap else 0.0)  # fmt: skip
        yield _counter("num_preemptions", "Preemptions", s["preemptions_total"])
        yield _counter("prefix_cache_queries", "Prefill tokens looked up in the prefix cache",
                       s["prefix_cache_queries_total"])  # fmt: skip
        yield _counter("prefix_cache_hits", "Prefill tokens found in the prefix cache",
                       s["prefix_cache_hits_total"])  # fmt: skip
        yield _counter("prompt_tokens", "Prompt tokens processed", s["prompt_tokens_total"])
        yield _counter("generation_tokens", "Tokens generated", s["generation_tokens_total"])
        yield _counter("spec_decode_num_drafts", "Verification steps of requests",
                       s["spec_drafts_total"])  # fmt: skip
        yield _counter("spec_decode_num_draft_tokens", "Draft tree nodes verified (roots "
                       "excluded)", s["spec_draft_tokens_total"])  # fmt: skip
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                       s["spec_accepted_tokens_total"])  # fmt: skip
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position (0 = depth 1)",
                                      labels=["position"])  # fmt: skip
        for pos, n in enumerate(s["spec_accepted_per_depth"]):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        steps, drafts = s["spec_steps_total"], s["spec_draft_tokens_total"]
        yield _gauge("spec_decode_mean_tokens_per_step", "Tokens emitted per verification step",
                     s["spec_emitted_tokens_total"] / steps if steps else 0.0)  # fmt: skip
        yield _gauge("spec_decode_draft_acceptance_rate", "Accepted draft tokens / draft tokens",
                     s["spec_accepted_tokens_total"] / drafts if drafts else 0.0)  # fmt: skip


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=value)
