"""What ``pagedhybrid serve --replicas`` (``replicas``, the launcher) tells the Ray Serve
deployments (``replica_deployments``) the replicated application is made of: the one contract
between the two, and the engine deployment's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENGINE_DEPLOYMENT = "EngineReplica"


@dataclass(frozen=True)
class ReplicaSpec:
    """What the replicated application is made of (built from the command line)."""

    server_argv: tuple[str, ...]  # `pagedhybrid serve` arguments of each replica's server
    model_dir: str
    block_size: int
    num_replicas: int
    cpus_per_replica: float = 1.0
    router: str = "prefix"
    imbalance: int = 32
    min_match: float = 0.5
    capacity_pages: int = 1 << 16
    max_ongoing_requests: int = 256
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    start_timeout_s: float = 600.0
    shutdown_timeout_s: float = 10.0
    chat_template: str | None = None
    autoscaling: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)  # e.g. the API key, off the command line
