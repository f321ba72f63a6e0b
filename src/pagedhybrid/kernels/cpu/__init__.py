"""Fast CPU kernels (vectorised torch) for the three operator contracts.

* ``paged_attention``     -- tiled page reads + SDPA, GQA folded into the query axis (decode);
  per-sequence native-GQA SDPA with an lse-merged history/causal split (prefill).
* ``gated_delta_net``     -- chunked WY/UT form (chunk 64) for prefill, blocked in-place recurrent
  step for decode.
* ``varlen_causal_conv``  -- blocked shifted multiply-adds over the packed stream, explicit
  windows only for rows next to a sequence start.

Each function is registered against its op's ``SPEC`` (``SPEC.implement("torch")``): it takes the
spec's one signature, receives the ``BoundCall`` and validates it with that op's
``validate_call``; ``COVERAGE`` says what each fast path covers (nothing is delegated
silently). ``seam.py`` holds the model's step seam on these kernels (the ``torch`` backend of
``pagedhybrid.kernels.backend``).
"""

from __future__ import annotations

from pagedhybrid.kernels.cpu.gated_delta_net import COVERAGE as _GDN
from pagedhybrid.kernels.cpu.gated_delta_net import gated_delta_net
from pagedhybrid.kernels.cpu.paged_attention import COVERAGE as _PA
from pagedhybrid.kernels.cpu.paged_attention import paged_attention
from pagedhybrid.kernels.cpu.varlen_causal_conv import COVERAGE as _CONV
from pagedhybrid.kernels.cpu.varlen_causal_conv import varlen_causal_conv

__all__ = ["COVERAGE", "gated_delta_net", "paged_attention",
           "varlen_causal_conv"]

COVERAGE = {c.op: c for c in (_PA, _CONV, _GDN)}
