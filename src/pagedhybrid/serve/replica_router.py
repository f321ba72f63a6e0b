"""The Ray Serve ``RequestRouter`` of the engine replicas: ``replica_routing``'s policy with
Ray Serve's hooks.

Ray Serve builds it in every process that holds a handle to the engine deployment (here the
ingress) from ``request_router_kwargs`` (``policy``, ``capacity_pages``, ``imbalance``,
``min_match``, ``seed``). ``choose_replicas`` reads the request's ``Route`` (its ``route``
keyword) and answers ``replica_routing.choose``'s ranking, one replica per rank, and at once
takes the first choice as where the request goes -- its turn, an in-flight request and the
prompt's page hashes (the approximate prefix index) -- so that requests routed together (a
burst) see each other; ``on_request_routed`` moves that to the replica that did take it when
it is another, and the request counts in flight until ``on_request_completed``;
``update_replicas`` forgets replicas that are gone.

Ray Serve ships this class pickled by value (a copy of this module), so it keeps no state of its
own at module level: everything shared with the ingress lives in ``replica_routing``, which the
copy reaches by import.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedhybrid.serve import replica_routing
from pagedhybrid.serve.replica_routing import POLICIES, Choice, PrefixIndex, Route, choose

_MAX_PENDING = 4096


class ReplicaRouter(RequestRouter):
    """Prefix-aware (or round-robin / random) routing over the engine replicas."""

    def initialize_state(self, policy: str = "prefix", capacity_pages: int = 1 << 16,
                         imbalance: int = 32, min_match: float = 0.5, seed: int | None = None,
                         **_: Any) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (one of {POLICIES})")
        self.policy = policy
        self.imbalance = imbalance
        self.min_match = min_match
        self.index = PrefixIndex(capacity_pages)
        self.rng = random.Random(seed)
        self.turn = 0
        self.in_flight: dict[str, int] = {}
        self._routed: dict[str, str] = {}  # internal request id -> replica unique id
        self._pending: dict[str, Choice] = {}  # internal request id -> the choice made
        self._taken: dict[str, str] = {}  # internal request id -> its first choice, counted
        self.replica_ids: tuple[str, ...] = ()
        self.lock = threading.Lock()  # counters read from the ingress's thread
        self.routed: dict[tuple[str, str], int] = {}  # (replica, reason) -> requests
        self.matched_pages: dict[str, int] = {}  # replica -> predicted matched pages
        did = self._deployment_id
        if did is not None:
            replica_routing.register_router(did.app_name, did.name, self)

    # -- Ray Serve's hooks ---------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        route = _route_of(pending_request)
        choice = choose(self.policy, list(by_id), route, self.in_flight, self.index,
                        self.imbalance, self.turn, self.rng, self.min_match)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all ranks tried: back off
            req = pending_request.metadata.internal_request_id
            self._untake(req)  # (chosen again after a back-off)
            self._pending[req] = choice
            if choice.ranks and route.pin is None:  # counted now: a burst sees it
                first = choice.ranks[0]
                self._taken[req] = first
                self.turn += 1
                self.in_flight[first] = self.in_flight.get(first, 0) + 1
                if route.hashes:
                    self.index.record(first, route.hashes)
            while len(self._pending) > _MAX_PENDING:  # choices of requests cancelled unrouted
                old = next(iter(self._pending))
                self._pending.pop(old)
                self._untake(old)
        return [[by_id[c]] for c in choice.ranks if c in by_id]

    def _untake(self, req: str) -> None:
        first = self._taken.pop(req, None)
        if first is not None and self.in_flight.get(first, 0) > 0:
            self.in_flight[first] -= 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        rid, req = replica_id.unique_id, pending_request.metadata.internal_request_id
        route = _route_of(pending_request)
        choice = self._pending.pop(req, None)
        first = self._taken.pop(req, None)
        self._routed[req] = rid
        if first != rid:  # another replica took it than the one counted at the choice
            if first is not None and self.in_flight.get(first, 0) > 0:
                self.in_flight[first] -= 1
            else:
                self.turn += 1
            self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
            if route.hashes:
                self.index.record(rid, route.hashes)
        reason = "pinned" if route.pin is not None else (
            choice.reason if choice is not None and choice.ranks[:1] == (rid,) else "fallback")
        with self.lock:
            self.routed[(rid, reason)] = self.routed.get((rid, reason), 0) + 1
            if reason == "prefix" and choice is not None:
                self.matched_pages[rid] = self.matched_pages.get(rid, 0) + choice.matched_pages

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)
        rid = self._routed.pop(internal_request_id, None)
        if rid is not None and self.in_flight.get(rid, 0) > 0:
            self.in_flight[rid] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        self.index.keep_only(ids)
        for rid in [r for r in self.in_flight if r not in ids]:
            del self.in_flight[rid]
        self.replica_ids = tuple(sorted(ids))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.keep_only({r for r in self.replica_ids if r != replica_id.unique_id})

    # -- read by the ingress -------------------------------------------------------------------
    def counters(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        with self.lock:
            return dict(self.routed), dict(self.matched_pages)


def _route_of(pending_request: PendingRequest | None) -> Route:
    if pending_request is None:
        return Route()
    route = pending_request.kwargs.get("route")
    return route if isinstance(route, Route) else Route()
