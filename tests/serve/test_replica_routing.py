"""The replicated server's parts that need no cluster: the routing policy, the metrics
aggregation, the replica servers' command line and the option checks."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedhybrid.engine.core.pages import chain_hashes
from pagedhybrid.serve.cli import serve_parser
from pagedhybrid.serve.metrics import ServerMetrics
from pagedhybrid.serve.replica_metrics import ReplicaMetrics, aggregate, parse_totals
from pagedhybrid.serve.replica_routing import PrefixIndex, Route, choose
from pagedhybrid.serve.replicas import (
    ReplicaOptionError,
    check_capacity,
    connect_ray,
    replica_spec,
    server_argv,
)
from server_process import free_port

BS = 16


def hashes(ids: list[int]) -> tuple[int, ...]:
    return tuple(chain_hashes(ids, BS, None))


def route(policy: str, ids: list[int], index: PrefixIndex, load: dict[str, int],
          min_match: float = 0.5, imbalance: int = 4) -> str:
    c = choose(policy, ["a", "b"], Route(hashes(ids)), load, index, imbalance, 0,
               random.Random(0), min_match)
    index.record(c.ranks[0], hashes(ids))
    return c.ranks[0]


def test_prefix_policy_sends_a_shared_prefix_to_the_replica_that_holds_it() -> None:
    index = PrefixIndex(1 << 10)
    template = list(range(16))  # one page every prompt shares (a chat template's start)
    system = {k: template + [100 * k + j for j in range(80)] for k in range(4)}
    first = {k: route("prefix", system[k] + [1, 2, 3], index, {}) for k in range(4)}
    assert sorted(first.values()) == ["a", "a", "b", "b"]  # new prefixes spread (least cached)
    for k in range(4):
        for q in range(3):
            assert route("prefix", system[k] + [7, q], index, {}) == first[k]


def test_prefix_policy_falls_back_to_the_least_loaded() -> None:
    index = PrefixIndex(1 << 10)
    ids = list(range(100))
    index.record("a", hashes(ids))
    assert route("prefix", ids, index, {"a": 3, "b": 0}) == "a"  # within the imbalance
    assert route("prefix", ids, index, {"a": 9, "b": 0}) == "b"  # too busy: least loaded
    assert route("prefix", [5] * 100, index, {"a": 0, "b": 2}) == "a"  # no match: least loaded
    # a match under min_match of the prompt's pages does not count; with 0 any page does
    for min_match, expected in ((0.5, "b"), (0.0, "a")):
        short = PrefixIndex(1 << 10)
        short.record("a", hashes(ids[:16]))
        assert route("prefix", ids[:16] + [9] * 90, short, {"a": 1, "b": 0},
                     min_match=min_match) == expected


def test_prefix_index_forgets_the_oldest_pages_and_gone_replicas() -> None:
    index = PrefixIndex(4)
    old, new = hashes(list(range(64))), hashes(list(range(1000, 1064)))
    index.record("a", old)
    assert index.match("a", old) == 4
    index.record("a", new)
    assert index.match("a", old) == 0 and index.match("a", new) == 4
    index.keep_only({"b"})
    assert index.size("a") == 0


def test_pins_avoids_and_the_baselines() -> None:
    index, rng = PrefixIndex(16), random.Random(1)
    assert choose("prefix", ["a", "b"], Route(pin="b"), {}, index, 4, 0, rng).ranks == ("b",)
    gone = choose("prefix", ["a", "b"], Route(pin="c"), {}, index, 4, 0, rng)
    assert set(gone.ranks) == {"a", "b"}  # answered elsewhere; the caller checks who answered
    assert choose("prefix", ["a", "b"], Route(avoid=frozenset({"a"})), {}, index, 4, 0,
                  rng).ranks == ("b",)
    assert [choose("round_robin", ["a", "b"], Route(), {}, index, 4, t, rng).ranks[0]
            for t in range(4)] == ["a", "b", "a", "b"]
    seen = {choose("random", ["a", "b"], Route(), {}, index, 4, 0, rng).ranks[0]
            for _ in range(50)}
    assert seen == {"a", "b"}


def test_metrics_are_labelled_per_replica_and_aggregated() -> None:
    a, b = ServerMetrics("m"), ServerMetrics("m")
    a.prompt_tokens.labels(model_name="m").inc(5)
    b.prompt_tokens.labels(model_name="m").inc(7)
    a.kv_usage.labels(model_name="m").set(0.5)
    b.kv_usage.labels(model_name="m").set(0.25)
    a.ttft.labels(model_name="m").observe(0.1)
    text = aggregate([ReplicaMetrics("r1", {"pid": "1", "port": "2", "node": "n"},
                                     a.render().decode()),
                      ReplicaMetrics("r2", {"pid": "3", "port": "4", "node": "n"},
                                     b.render().decode())],
                     {("r1", "prefix"): 3}, {"r1": 9}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition
    assert families["pagedhybrid:prompt_tokens"].type == "counter"
    assert parse_totals(text, "r1")["pagedhybrid:prompt_tokens_total"] == 5
    assert parse_totals(text)["pagedhybrid:prompt_tokens_total"] == 12
    assert parse_totals(text)["pagedhybrid:kv_cache_usage_perc"] == 0.375  # a share: the mean
    assert parse_totals(text)["pagedhybrid:time_to_first_token_seconds_count"] == 1
    assert 'pagedhybrid:replica_info{node="n",pid="3",port="4",replica="r2"} 1.0' in text
    assert 'pagedhybrid:router_requests_total{reason="prefix",replica="r1"} 3.0' in text
    assert "pagedhybrid:num_replicas 2.0" in text


def test_replica_servers_get_the_engine_options_and_not_the_launchers() -> None:
    p = serve_parser()
    args = p.parse_args(["/m", "--replicas", "2", "--router", "random", "--port", "9000",
                         "--api-key", "secret", "--max-num-seqs", "4", "--num-blocks", "32",
                         "--no-enable-prefix-caching", "--batch-invariant",
                         "--speculative-config", '{"method": "ngram"}',
                         "--cpus-per-replica", "0.5", "--served-model-name", "x"])
    argv = server_argv(p, args)
    assert argv[0] == "/m"
    assert sorted(argv[1:]) == sorted([
        "--served-model-name", "x", "--max-num-seqs", "4", "--num-blocks", "32",
        "--no-enable-prefix-caching", "--batch-invariant",
        "--speculative-config", '{"method": "ngram"}'])
    assert "secret" not in " ".join(argv)  # the key goes by environment
    # and the server's own parser takes them back as they were
    again = p.parse_args(argv)
    for dest in ("max_num_seqs", "num_blocks", "enable_prefix_caching", "batch_invariant",
                 "speculative_config", "served_model_name", "model_dir"):
        assert getattr(again, dest) == getattr(args, dest), dest


@pytest.mark.parametrize(("argv", "option"), [
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "2", "--min-replicas", "1"], "--max-replicas"),
    (["--replicas", "2", "--max-replicas", "3"], "--min-replicas"),
    (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "3"], "--replicas"),
    (["--replicas", "1", "--min-replicas", "2", "--max-replicas", "1"], "--max-replicas"),
    (["--replicas", "1", "--cpus-per-replica", "0"], "--cpus-per-replica"),
    (["--replicas", "1", "--router-min-match", "1.5"], "--router-min-match"),
    (["--replicas", "1", "--health-check-period", "0"], "--health-check-period"),
])
def test_bad_options_are_refused_naming_the_option(argv: list[str], option: str) -> None:
    p = serve_parser()
    with pytest.raises(ReplicaOptionError) as err:
        replica_spec(p.parse_args(argv), p)
    assert err.value.option == option and str(err.value).startswith(option)


def test_replicas_beyond_the_clusters_cpus_are_refused() -> None:
    p = serve_parser()
    spec = replica_spec(p.parse_args(["--replicas", "3"]), p)
    check_capacity(spec, 3.0)
    with pytest.raises(ReplicaOptionError, match="3 CPUs; the Ray cluster has 2") as err:
        check_capacity(spec, 2.0)
    assert err.value.option == "--replicas"
    auto = replica_spec(p.parse_args(["--replicas", "1", "--min-replicas", "1",
                                      "--max-replicas", "4"]), p)
    with pytest.raises(ReplicaOptionError) as err:
        check_capacity(auto, 2.0)
    assert err.value.option == "--max-replicas"


def test_an_unreachable_ray_address_is_refused_at_once() -> None:
    with pytest.raises(ReplicaOptionError, match="cannot be reached") as err:
        connect_ray(f"127.0.0.1:{free_port()}")
    assert err.value.option == "--ray-address"
    with pytest.raises(ReplicaOptionError) as err:
        connect_ray("not an address")
    assert err.value.option == "--ray-address"


def test_the_replica_options_never_reach_the_replicas_servers() -> None:
    p = serve_parser()
    args = p.parse_args(["--replicas", "2", "--router", "round_robin", "--max-num-seqs", "4",
                         "--health-check-period", "2"])
    assert server_argv(p, args) == ["--max-num-seqs", "4"]
