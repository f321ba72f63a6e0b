"""``pagedhybrid dispatch explain CONTRACT.json``: print a dispatch decision and its rejections.

``CONTRACT.json`` is an ``AttentionContract.to_dict()`` object, or ``{"contract": {...},
"requested_backend": "...", "platform": "..."}``; ``--backend`` / ``--platform`` override the
file. Exit status: 0 when a backend is selected, 1 when dispatch refuses, 2 when the file is not
a valid contract. ``--json`` prints the explanation as JSON instead of text.

The lead's ``pagedhybrid.cli`` wires it with ``register_subcommands(subparsers)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedhybrid.attention.contract import AttentionContract
from pagedhybrid.attention.registry import AttentionRegistry, DispatchExplanation
from pagedhybrid.errors import PagedHybridError


def register_subcommands(subparsers: Any) -> None:
    """Add ``dispatch explain`` to an argparse subparsers object."""
    d = subparsers.add_parser("dispatch", help="contract-aware attention dispatch")
    dsub = d.add_subparsers(dest="dispatch_command", required=True)
    e = dsub.add_parser("explain", help="print the dispatch decision for an attention contract")
    e.add_argument("contract", help="AttentionContract JSON file")
    e.add_argument("--backend", default=None,
                   help="requested backend: auto | production | reference | a backend id")
    e.add_argument("--platform", default=None, help="restrict to one platform (cpu, webgpu)")
    e.add_argument("--json", action="store_true", help="print the explanation as JSON")
    e.set_defaults(func=lambda a: explain_main(a.contract, requested_backend=a.backend,
                                               platform=a.platform, as_json=a.json))


def explain_main(path: str, *, requested_backend: str | None = None,
                 platform: str | None = None, as_json: bool = False,
                 registry: AttentionRegistry | None = None) -> int:
    try:
        raw = json.loads(Path(path).read_text())
        if isinstance(raw, dict) and "contract" in raw:
            requested_backend = requested_backend or raw.get("requested_backend")
            platform = platform or raw.get("platform")
            raw = raw["contract"]
        contract = AttentionContract.from_dict(raw)
    except (OSError, ValueError, TypeError, PagedHybridError) as e:
        print(f"invalid contract {path}: {e}", file=sys.stderr)
        return 2
    if registry is None:
        from pagedhybrid.attention.backends import default_registry

        registry = default_registry()
    ex = registry.explain(contract, requested_backend=requested_backend or "auto",
                          platform=platform)
    print(json.dumps(ex.to_dict(), indent=2, sort_keys=True) if as_json
          else format_explanation(contract, ex))
    return 0 if ex.selected is not None else 1


def format_explanation(contract: AttentionContract, ex: DispatchExplanation) -> str:
    sh = contract.sharding
    rope = "none" if contract.rope is None else contract.rope.fusion_boundary.value
    lines = [
        f"contract: role={contract.role.value} mode={contract.mode.value} "
        f"dtype={contract.dtype.value} TP={sh.tp_world_size} CP={sh.cp_world_size} "
        f"packed={sh.is_packed} kv_cache={contract.kv_cache is not None} rope={rope} "
        f"head_dim={contract.head_dim} heads={sh.local_q_heads}/{sh.local_kv_heads} (local q/kv)",
        f"requested backend: {ex.requested_backend}"
        + (f" on platform {ex.platform}" if ex.platform else ""),
    ]
    if ex.selected is not None:
        p = ex.provenance
        assert p is not None
        lines.append(f"selected: {ex.selected} ({p.implementation_kind}, platform {p.platform})"
                     f" fallback={'yes' if ex.fallback else 'no'}")
        if p.communication_backend:
            lines.append(f"communication: {p.communication_backend}")
    else:
        lines.append(f"REFUSED: {ex.refusal}")
    lines.append("backends (priority order):")
    for backend_id, reasons in ex.rejections.items():
        if backend_id == ex.selected:
            mark = "selected"
        elif backend_id in ex.policy_skipped:
            mark = "skipped by policy; " + ("; ".join(reasons) if reasons else "compatible")
        else:
            mark = "; ".join(reasons) if reasons else "compatible (not reached)"
        lines.append(f"  {backend_id}: {mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # standalone entry, for the tests and scripts
    p = argparse.ArgumentParser(prog="pagedhybrid")
    register_subcommands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return int(args.func(args))
