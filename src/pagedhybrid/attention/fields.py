"""Building blocks of the attention contract: the typed error, string enums and field checks.

Every contract object (``pagedhybrid.attention.contract``) validates its fields at construction
with the helpers here. A failed check raises ``AttentionContractError(obj, field, rule, got)``,
a ``ContractViolation`` whose message names the object, the field and the rule, e.g.
``ShardingSpec: 'local_q_heads' must equal global_q_heads / tp_world_size = 16 (got 8)``.

Enums are ``StrEnum``s, so a contract serialises to stable JSON with plain strings and compares
equal to the strings it was built from. ``JsonObject`` gives the dataclasses ``to_dict`` /
``from_dict`` / ``to_json`` / ``from_json`` (lists come back as tuples, nested objects through
their own ``from_dict``, unknown keys are rejected).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import fields
from enum import StrEnum
from typing import Any, TypeVar

from pagedhybrid.errors import ContractViolation


class AttentionContractError(ContractViolation):
    """An attention contract object is incomplete or inconsistent.

    ``op`` is the object (``ShardingSpec``, ``KVCacheSpec`` ...), ``where`` the field, ``rule``
    the rule that failed, ``got`` the offending value.
    """


class AttentionRole(StrEnum):
    TRAIN = "train"
    INFER = "infer"


class AttentionMode(StrEnum):
    PREFILL = "prefill"
    CHUNKED_PREFILL = "chunked_prefill"
    DECODE = "decode"


class AttentionDType(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class AttentionMerge(StrEnum):
    ONLINE_SOFTMAX_LSE = "online_softmax_lse"


class ReductionOrder(StrEnum):
    GLOBAL_BLOCK_INDEX = "global_block_index"


class DowncastPoint(StrEnum):
    FINAL_WRITE = "final_write"


class ReductionEngine(StrEnum):
    IN_OP_REFERENCE = "in_op_reference"


class PartialState(StrEnum):
    OUT_ATTENTION_LSE = "out_attention_lse"


class RoPEState(StrEnum):
    PRE_ROPE = "pre_rope"
    POST_ROPE = "post_rope"


class RoPECastPoint(StrEnum):
    NONE = "none"
    BEFORE_ROPE = "before_rope"
    AFTER_ROPE = "after_rope"


class RoPEFusionBoundary(StrEnum):
    UNFUSED_ROPE_ATTENTION = "unfused_rope_attention"
    FUSED_ROPE_ATTENTION = "fused_rope_attention"


class ImplementationKind(StrEnum):
    PRODUCTION = "production"
    REFERENCE = "reference"
    DETERMINISTIC = "deterministic"


E = TypeVar("E", bound=StrEnum)


class Checker:
    """Field checks of one contract object; every failure names ``obj`` and the field."""

    def __init__(self, obj: str) -> None:
        self.obj = obj

    def fail(self, field: str, rule: str, got: object = None) -> AttentionContractError:
        return AttentionContractError(self.obj, field, rule, got)

    def check(self, cond: bool, field: str, rule: str, got: object = None) -> None:
        if not cond:
            raise self.fail(field, rule, got)

    def enum(self, enum_type: type[E], value: Any, field: str) -> E:
        try:
            return enum_type(value)
        except (TypeError, ValueError):
            allowed = [e.value for e in enum_type]
            raise self.fail(field, f"must be one of {allowed}", repr(value)) from None

    def integer(self, value: Any, field: str, *, minimum: int | None = None) -> int:
        self.check(isinstance(value, int) and not isinstance(value, bool), field,
                   "must be an integer", repr(value))
        if minimum is not None:
            self.check(value >= minimum, field, f"must be >= {minimum}", value)
        return int(value)

    def positive(self, value: Any, field: str) -> int:
        return self.integer(value, field, minimum=1)

    def non_negative(self, value: Any, field: str) -> int:
        return self.integer(value, field, minimum=0)

    def ints(self, values: Any, field: str, *, minimum: int | None = None) -> tuple[int, ...]:
        self.check(isinstance(values, Iterable) and not isinstance(values, (str, bytes)), field,
                   "must be a sequence of integers", repr(values))
        out = tuple(values)
        for i, v in enumerate(out):
            self.integer(v, f"{field}[{i}]", minimum=minimum)
        return tuple(int(v) for v in out)

    def strictly_increasing(self, values: tuple[int, ...], field: str) -> None:
        for i in range(1, len(values)):
            self.check(values[i] > values[i - 1], field, "must be strictly increasing",
                       list(values))

    def offsets(self, values: Any, field: str, *, end: int, end_name: str) -> tuple[int, ...]:
        """Boundaries ``[0, ..., end]``: starts at 0, strictly increasing, ends at ``end``."""
        out = self.ints(values, field)
        self.check(len(out) >= 2, field, "must hold at least two boundaries [0, ..., end]",
                   list(out))
        self.check(out[0] == 0, field, "must start at 0", list(out))
        self.strictly_increasing(out, field)
        self.check(out[-1] == end, field, f"must end at {end_name} = {end}", list(out))
        return out

    def finite_positive(self, value: Any, field: str) -> float:
        self.check(isinstance(value, (int, float)) and not isinstance(value, bool), field,
                   "must be a number", repr(value))
        self.check(math.isfinite(value) and value > 0, field, "must be finite and > 0", value)
        return float(value)


def enum_value(value: Any) -> Any:
    """JSON form of a field value: enums as strings, tuples as lists (recursively)."""
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return [enum_value(v) for v in value]
    if isinstance(value, dict):
        return {k: enum_value(v) for k, v in value.items()}
    return value


class JsonObject:
    """``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` for flat contract objects."""

    _nested: dict[str, type] = {}  # noqa: RUF012 -- per-class constant

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if hasattr(v, "to_dict") else enum_value(v)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        c = Checker(cls.__name__)
        c.check(isinstance(d, dict), "<dict>", "must be a JSON object", type(d).__name__)
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names - set(cls._ignored()))
        c.check(not unknown, "<dict>", "has unknown fields", unknown)
        kwargs: dict[str, Any] = {}
        for k, v in d.items():
            if k not in names:
                continue
            if k in cls._nested and v is not None:
                v = cls._nested[k].from_dict(v)
            kwargs[k] = _tupled(v)
        return cls(**kwargs)

    @classmethod
    def _ignored(cls) -> tuple[str, ...]:
        return ()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls.from_dict(json.loads(text))


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v
