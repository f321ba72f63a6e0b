"""Prefix-aware routing of requests over engine replicas: the policy (``replica_router`` is the
Ray Serve ``RequestRouter`` that applies it).

Each request carries a ``Route``: the content hashes of its prompt's full KV pages (the engine's
own ``engine.pages.chain_hashes`` of the token ids the server will compute, block size and extra
key as the engine's), or a replica it must go to (``pin``: per-replica metrics and health), and
replicas to avoid (one whose engine server was found gone).

State (``PrefixIndex``, in the router's process -- the ingress's): for every replica, the page
hashes of the prompts routed to it, in LRU order, at most ``capacity_pages`` of them (the
replica's KV pages; older ones are taken as evicted). It is an approximation of each replica's
prefix cache, kept by what was sent where (SGLang's approximate radix tree, here on page hashes;
the servers' KV-cache events, ``--kv-events-config``, are not subscribed to yet). Because the
hashes chain, a replica holding page ``j`` of a prompt's chain holds the whole prefix up to it,
so the match of a replica is the run of leading hashes it holds.

Policies (``choose``, a pure function of that state):

* ``prefix`` -- the replica with the longest matching run (ties: fewest requests in flight),
  when that run covers at least ``min_match`` of the prompt's full pages (and one page) and the
  replica has at most ``imbalance`` requests in flight more than the least-loaded one;
  otherwise the least-loaded replica (fewest in flight, then fewest tracked pages -- the
  smallest cache spreads new prefixes over the replicas --, then at random). The ``min_match``
  share (SGLang's cache-aware ``cache_threshold``, 0.5 by default here) is what keeps a prefix
  every prompt shares -- the chat template's first page -- from sending all new prompts to
  the first replica that served one; ``min_match=0`` routes on any matching page.
* ``round_robin`` / ``random`` -- the baselines (benchmarks, tests).

The answer is a ranking, one replica per rank: Ray Serve sends to the first that accepts (has
fewer than ``max_ongoing_requests``), trying the next ranks before backing off. In-flight counts
are the router's own (requests it routed that have not completed).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POLICIES = ("prefix", "round_robin", "random")


@dataclass(frozen=True)
class Route:
    """How one request wants to be routed (passed as the ``route`` keyword of the call)."""

    hashes: tuple[int, ...] = ()  # chain hashes of the prompt's full pages
    pin: str | None = None  # a replica's unique id: this replica only
    avoid: frozenset[str] = frozenset()  # replica unique ids not to use (while others exist)


@dataclass(frozen=True)
class Choice:
    ranks: tuple[str, ...]  # replica unique ids, most preferred first
    reason: str  # prefix | least_loaded | round_robin | random | pinned
    matched_pages: int = 0


class PrefixIndex:
    """Per replica, the page hashes routed to it (LRU, at most ``capacity_pages``)."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = max(1, capacity_pages)
        self._pages: dict[str, OrderedDict[int, None]] = {}

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        held = self._pages.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        held = self._pages.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_pages:
            held.popitem(last=False)

    def size(self, replica: str) -> int:
        return len(self._pages.get(replica, ()))

    def keep_only(self, replicas: set[str]) -> None:
        for r in [r for r in self._pages if r not in replicas]:
            del self._pages[r]


def choose(policy: str, candidates: Sequence[str], route: Route, in_flight: Mapping[str, int],
           index: PrefixIndex, imbalance: int, turn: int, rng: random.Random,
           min_match: float = 0.0) -> Choice:
    """The ranking of ``candidates`` for one request (see the module docstring)."""
    if route.pin is not None:
        # a replica that is gone: anywhere (the caller sees the answering replica's id)
        return Choice((route.pin,) if route.pin in candidates else tuple(candidates), "pinned")
    cands = [c for c in candidates if c not in route.avoid] or list(candidates)
    if not cands:
        return Choice((), "none")

    def load(c: str) -> int:
        return in_flight.get(c, 0)

    def least_loaded() -> list[str]:
        keyed = [(load(c), index.size(c), rng.random(), c) for c in cands]
        return [c for *_, c in sorted(keyed)]

    if policy == "round_robin":
        k = turn % len(cands)
        return Choice(tuple(cands[k:] + cands[:k]), "round_robin")
    if policy == "random":
        order = list(cands)
        rng.shuffle(order)
        return Choice(tuple(order), "random")
    if route.hashes:
        matches = {c: index.match(c, route.hashes) for c in cands}
        best = max(matches.values())
        if best > 0 and best >= min_match * len(route.hashes):
            least = min(load(c) for c in cands)
            order = sorted(cands, key=lambda c: (-matches[c], load(c), rng.random()))
            if load(order[0]) - least <= imbalance:
                return Choice(tuple(order), "prefix", best)
    return Choice(tuple(least_loaded()), "least_loaded")


# The routers of this process by (app name, deployment name): the ingress reads the replica
# set (per-replica metrics and health) and the routing counters from them. (Ray Serve ships a
# router class pickled by value -- a copy of its module -- so the registry lives here, in a
# module the router reaches by import.)
_ROUTERS: dict[tuple[str, str], Any] = {}


def register_router(app_name: str, deployment: str, router: Any) -> None:
    _ROUTERS[(app_name, deployment)] = router


def router_of(app_name: str, deployment: str) -> Any:
    return _ROUTERS.get((app_name, deployment))
