"""Prometheus metrics of a served drafter, at /metrics. The speculation counters are the engine's own running totals
(runtime.serving.spec_counters), read only when scraped, so the step loop pays nothing for them; vLLM's names, under
this project's prefix. Latencies and request counts are observed per request on the server's event loop."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pipeline.serving.drift import DriftMonitor

PREFIX = "draftsmith_"
SPEC = PREFIX + "spec_decode_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _SpecCollector:
    """Reads the counters and the drift monitor at scrape time."""

    def __init__(self, counters, drift: DriftMonitor):
        self.counters, self.drift = counters, drift

    def collect(self):
        c = self.counters
        for name, doc, value in (
                ("num_drafts", "row verifies that checked a draft of at least one token", c.drafts),
                ("num_draft_tokens", "draft tokens proposed", c.draft_tokens),
                ("num_accepted_tokens", "draft tokens the target accepted", c.accepted_tokens),
                ("plain_steps", "row steps decoded without a draft while a drafter was loaded (the batch policy's "
                 "plain decoding at that batch size, the fallback rule, or no room left)", c.plain_steps)):
            yield CounterMetricFamily(SPEC + name, doc, value=value)
        per_pos = CounterMetricFamily(SPEC + "num_accepted_tokens_per_pos", "drafts whose token at this draft "
                                      "position (0: the first) was accepted", labels=["position"])
        for d, n in enumerate(list(c.accepted_per_pos)):
            per_pos.add_metric([str(d)], n)
        yield per_pos
        counts = dict(c.tokens_per_verify)
        top = max(counts, default=1)
        buckets = [(str(k), sum(n for t, n in counts.items() if t <= k)) for k in range(1, top + 1)]
        yield HistogramMetricFamily(SPEC + "tokens_per_verify", "tokens a drafted verify committed (accepted + 1)",
                                    buckets=buckets + [("+Inf", sum(counts.values()))],
                                    sum_value=sum(t * n for t, n in counts.items()))
        tau = c.rolling_tau()
        yield GaugeMetricFamily(SPEC + "rolling_tau", f"tokens per drafted verify over the last {c.window} drafted "
                                "verifies (NaN before any)", value=float("nan") if tau is None else tau)
        validated = self.drift.validated_tau
        yield GaugeMetricFamily(SPEC + "validated_tau", "tau validate measured for the served bundle (NaN: unknown)",
                                value=float("nan") if validated is None else validated)
        yield GaugeMetricFamily(PREFIX + "drift_alert", "1 while the rolling tau stays below the validated tau by "
                                "more than the drift margin", value=float(self.drift.check()))
        yield CounterMetricFamily(PREFIX + "engine_steps", "batched engine steps (one target forward each)",
                                  value=c.steps)


class _OutcomeCollector:
    def __init__(self, name: str, doc: str, counts):
        self.name, self.doc, self.counts = name, doc, counts

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=["outcome"])
        for outcome, n in list(self.counts.items()):
            family.add_metric([outcome], n)
        yield family


class ServingMetrics:
    """One registry per server, so several servers (and tests) in one process keep their own."""

    def __init__(self, served, drift: DriftMonitor):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "seconds per token after a reply's first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        Gauge(PREFIX + "queue_depth", "rows accepted and waiting for a place in the batch",
              registry=r).set_function(lambda: served.scheduler.rows_waiting)
        Gauge(PREFIX + "batch_size", "rows in the batch now", registry=r).set_function(lambda: served.engine.running)
        Gauge(PREFIX + "max_batch_size", "rows the engine decodes together at most",
              registry=r).set(served.engine.max_batch)
        r.register(_SpecCollector(served.engine.counters, drift))

    def watch(self, name: str, doc: str, read) -> None:
        """A gauge that reads `read()` at scrape time."""
        Gauge(PREFIX + name, doc, registry=self.registry).set_function(read)

    def count_outcomes(self, name: str, doc: str, counts) -> None:
        """A counter by `outcome` that reads the mapping `counts` (outcome -> count) at scrape time."""
        self.registry.register(_OutcomeCollector(PREFIX + name, doc, counts))

    def observe(self, reply) -> None:
        """A finished reply's latencies (pipeline.serving.reply.Reply)."""
        if reply.first_token_s is not None:
            self.ttft.observe(reply.first_token_s)
        tpot = reply.time_per_output_token
        if tpot is not None:
            self.tpot.observe(tpot)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
