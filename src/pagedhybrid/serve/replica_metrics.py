"""The metrics of N engine replicas as one Prometheus text (the replicated endpoint's
``GET /metrics``).

Input: each replica's own ``/metrics`` text (``serve.metrics``: ``pagedhybrid:*`` series
labelled ``model_name``) with its Ray Serve replica id. Output, per metric family (HELP and TYPE
once):

* every series of every replica, with a ``replica="<id>"`` label added;
* the aggregate over replicas, labelled ``replica="all"``: the sum for counters, histograms
  (buckets, ``_sum``, ``_count``) and gauges -- except the ``*_perc`` gauges (a share of a
  replica's own pool), whose aggregate is the mean. ``sum without (replica)`` in PromQL must
  therefore exclude ``replica="all"``.

Then the router's own families: ``pagedhybrid:replica_info{replica, pid, port, node}`` (1 per
live replica), ``pagedhybrid:num_replicas``, ``pagedhybrid:router_requests_total{replica,
reason}`` (reason: prefix | least_loaded | round_robin | random | pinned | fallback) and
``pagedhybrid:router_matched_pages_total{replica}`` (pages the router expected the replica to
hold for the requests it sent there by prefix).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

P = "pagedhybrid:"
ALL = "all"


@dataclass(frozen=True)
class ReplicaMetrics:
    replica: str  # Ray Serve's replica unique id
    info: Mapping[str, str]  # pid, port, node
    text: str  # the replica's /metrics text ("" when it did not answer)


class _Static:
    """A collector that yields prepared metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def aggregate(replicas: Sequence[ReplicaMetrics],
              routed: Mapping[tuple[str, str], int] | None = None,
              matched_pages: Mapping[str, int] | None = None) -> bytes:
    """One Prometheus text of every replica's series, their aggregate and the router's."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for rep in replicas:
        if not rep.text:
            continue
        for fam in text_string_to_metric_families(rep.text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                totals[fam.name] = {}
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": rep.replica}, s.value)
                key = (s.name, tuple(sorted(s.labels.items())))
                totals[fam.name].setdefault(key, []).append(s.value)
    for name, fam in families.items():
        mean = fam.type == "gauge" and name.endswith("_perc")
        for (sample, labels), values in totals[name].items():
            value = sum(values) / len(values) if mean else sum(values)
            fam.add_sample(sample, {**dict(labels), "replica": ALL}, value)

    info = Metric(P + "replica_info", "Live engine replicas (1 each): server pid, port, node",
                  "gauge")
    for rep in replicas:
        info.add_sample(P + "replica_info", {"replica": rep.replica, **rep.info}, 1.0)
    count = Metric(P + "num_replicas", "Engine replicas the router knows", "gauge")
    count.add_sample(P + "num_replicas", {}, float(len(replicas)))
    req = Metric(P + "router_requests", "Requests routed, by replica and reason", "counter")
    for (replica, reason), n in sorted((routed or {}).items()):
        req.add_sample(P + "router_requests_total", {"replica": replica, "reason": reason},
                       float(n))
    pages = Metric(P + "router_matched_pages",
                   "Pages the router expected the replica to hold, over prefix-routed requests",
                   "counter")
    for replica, n in sorted((matched_pages or {}).items()):
        pages.add_sample(P + "router_matched_pages_total", {"replica": replica}, float(n))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static([*families.values(), info, count, req, pages]))  # type: ignore[arg-type]
    return generate_latest(registry)


def parse_totals(text: str, replica: str = ALL) -> dict[str, float]:
    """``{sample name: value summed over its other labels}`` of the series with ``replica`` (a
    reading aid for tests and benchmarks)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("replica") == replica:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out
