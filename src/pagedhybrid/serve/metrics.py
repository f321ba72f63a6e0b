"""Prometheus metrics of the server, named after vLLM's with the ``pagedhybrid:`` prefix.

Gauges (set after every engine step, from the core process's ``Snapshot``):
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (pages owned /
pages), ``state_slot_usage_perc``, and for prefix caching ``prefix_cache_cached_pages`` /
``prefix_cache_cached_checkpoints``. Counters: ``prompt_tokens_total``,
``generation_tokens_total``, ``num_preemptions_total``,
``request_success_total{finished_reason}``, ``prefix_cache_queries_total`` /
``prefix_cache_hits_total`` (tokens looked up / served from the cache, as vLLM counts them),
``prefix_cache_evictions_total{kind=page|checkpoint}``; with speculative decoding
``spec_decode_num_drafts_total``, ``spec_decode_num_draft_tokens_total``,
``spec_decode_num_accepted_tokens_total`` and ``spec_decode_num_accepted_tokens_per_pos_total
{position}`` (one series per draft position; the acceptance rate is accepted / draft tokens, per
position accepted-per-pos / drafts). Histograms (seconds):
``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``. Every metric carries ``model_name``; each server has its own
registry, exposed in the text format at ``GET /metrics``. Every series exists from the start
(counters at 0, one ``request_success_total`` per finish reason, one eviction series per kind),
and there are no ``*_created`` series.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pagedhybrid.engine import SequenceDelta
from pagedhybrid.serve.core import Snapshot

P = "pagedhybrid:"
FINISH_REASONS = ("stop", "length", "abort", "error")
disable_created_metrics()
LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str, draft_positions: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, label, registry=r)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(P + name, doc, [*label, *extra], registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, label, buckets=LATENCY, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages owned by requests")
        self.slot_usage = gauge("state_slot_usage_perc", "Fraction of state slots in use")
        self.cached_pages = gauge("prefix_cache_cached_pages", "Cached prefix KV pages")
        self.cached_checkpoints = gauge("prefix_cache_cached_checkpoints",
                                        "Cached state checkpoints")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Preemptions (by recompute)")
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.prefix_queries = counter("prefix_cache_queries", "Tokens looked up in the cache")
        self.prefix_hits = counter("prefix_cache_hits", "Tokens served from the prefix cache")
        self.evictions = counter("prefix_cache_evictions", "Prefix-cache evictions", ["kind"])
        self.spec = {k: counter(f"spec_decode_num_{k}", doc) for k, doc in (
            ("drafts", "Verify chunks (requests with drafts in a step)"),
            ("draft_tokens", "Draft tokens verified"),
            ("accepted_tokens", "Draft tokens accepted"))}
        self.spec_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position", ["position"])
        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish")
        for metric in (self.running, self.waiting, self.kv_usage, self.slot_usage,
                       self.cached_pages, self.cached_checkpoints, self.prompt_tokens,
                       self.generation_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.ttft, self.itl, self.e2e):
            metric.labels(model_name=model_name)  # the series exists (0) from the start
        for reason in FINISH_REASONS:
            self.success.labels(model_name=model_name, finished_reason=reason)
        for kind in ("page", "checkpoint"):
            self.evictions.labels(model_name=model_name, kind=kind)
        for c in self.spec.values():
            c.labels(model_name=model_name)
        for pos in range(draft_positions):
            self.spec_pos.labels(model_name=model_name, position=str(pos))
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "page": 0, "checkpoint": 0,
                      "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def _inc(self, metric: Counter, key: str, now: int, **labels: str) -> None:
        delta = now - self._seen.get(key, 0)
        if delta > 0:
            metric.labels(model_name=self.model_name, **labels).inc(delta)
        self._seen[key] = now

    def on_step(self, snap: Snapshot, outputs: Sequence[SequenceDelta]) -> None:
        """After each engine step (the core's ``Snapshot`` and the step's outputs): gauges and
        step counters."""
        m = self.model_name
        self.running.labels(model_name=m).set(snap.running)
        self.waiting.labels(model_name=m).set(snap.waiting)
        self.kv_usage.labels(model_name=m).set(snap.kv_usage)
        self.slot_usage.labels(model_name=m).set(snap.slot_usage)
        gen = sum(len(o.new_token_ids) for o in outputs)
        if gen:
            self.generation_tokens.labels(model_name=m).inc(gen)
        for o in outputs:
            if o.finished:
                self.success.labels(model_name=m, finished_reason=str(o.finish_reason)).inc()
                self.prompt_tokens.labels(model_name=m).inc(o.num_prompt_tokens)
        self._inc(self.preemptions, "preemptions", snap.preemptions)
        pc = snap.prefix
        self._inc(self.prefix_queries, "queries", int(pc["query_tokens"]))
        self._inc(self.prefix_hits, "hits", int(pc["hit_tokens"]))
        self._inc(self.evictions, "page", int(pc["page_evictions"]), kind="page")
        self._inc(self.evictions, "checkpoint", int(pc["checkpoint_evictions"]),
                  kind="checkpoint")
        for key, c in self.spec.items():
            self._inc(c, key, int(getattr(snap.spec, key)))
        for pos, n in enumerate(snap.spec.accepted_per_pos):
            self._inc(self.spec_pos, f"pos{pos}", n, position=str(pos))
        self.cached_pages.labels(model_name=m).set(pc["cached_pages"])
        self.cached_checkpoints.labels(model_name=m).set(pc["cached_checkpoints"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
