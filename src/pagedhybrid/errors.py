"""Typed errors of pagedhybrid.

Every rejection names what was wrong so a user can act on it:

* ``ContractViolation`` -- a tensor or attribute breaks an operator contract (which op, which
  port or attribute, the rule, and what was received).
* ``UnsupportedConfiguration`` -- a valid request that this build does not serve (a quantised
  cache, an unsupported model type, an execution provider without a kernel); the reason says what
  to do instead.
* ``CapacityError`` -- a request that can never fit the configured pools.

``from_mapping`` builds a typed config dataclass from an options mapping, refusing unknown keys
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


class PagedHybridError(Exception):
    """Base class of every error pagedhybrid raises on purpose."""


class ContractViolation(PagedHybridError, ValueError):
    """An input breaks an operator contract.

    ``op`` is the operator (``com.microsoft.PagedAttention``), ``where`` the port or attribute
    name, ``rule`` the rule that failed and ``got`` what was received.
    """

    def __init__(self, op: str, where: str, rule: str, got: object = None) -> None:
        self.op, self.where, self.rule, self.got = op, where, rule, got
        msg = f"{op}: '{where}' {rule}"
        if got is not None:
            msg += f" (got {got})"
        super().__init__(msg)


class UnsupportedConfiguration(PagedHybridError, NotImplementedError):
    """A well-formed request this build does not serve; ``reason`` says what to do instead."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class EngineDead(PagedHybridError, RuntimeError):
    """The engine can serve no more requests: a tensor-parallel rank went away (the message
    names it and how). Not the client's fault: a server answers 503."""


class CapacityError(PagedHybridError, RuntimeError):
    """A request that can never fit the configured KV pages or state slots."""


def from_mapping(cls: type[T], value: Mapping[str, Any], op: str) -> T:
    """``cls(**value)`` for a dataclass ``cls`` (an options mapping as its typed config); a key
    that is no field of ``cls`` is a ``ContractViolation`` of ``op`` naming it."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ContractViolation(op, unknown[0], f"is not a known key (known: {sorted(known)})",
                                value)
    return cls(**value)
