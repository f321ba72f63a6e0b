"""The contents of the PagedAttention package's ``test.json`` and ``bench.json``.

Both schemas are project-defined (the JS loader never reads these files; no public schema
exists). ``test.json``:

* ``cases[]``: ``{name, recipe, tunables?, expectVariant?}`` -- inputs come from the seeded
  recipe (``pagedhybrid.kernels.webgpu.cases.make_case``), expected outputs from the reference
  named in ``reference``; or ``{name, inputs, attrs, expected}`` with literal data
  (``{shape, dtype, data}`` per bind key), the expected output precomputed by that reference.
* ``tolerance``: ``atol``/``rtol`` per logical dtype, applied to ``outputT`` and to both caches.
* ``rejections[]``: ``{name, recipe, edit, error}`` -- the recipe's call edited by ``setAttrs``,
  ``drop`` (bind keys), ``bind`` (extra bind keys with an all-zero array of ``shape``/``dtype``)
  or ``cast`` (bind key -> dtype) must raise ``error`` before any GPU work.

``bench.json``: ``cases[]`` ``{name, kind, recipe, warmup, iters, tunables?, tuning?}``;
``tuning`` lists alternative tunable values the benchmark may sweep.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedhybrid.kernels.webgpu.cases import make_case

REFERENCE = "pagedhybrid.ops.paged_attention"
TOLERANCE = {"float16": {"atol": 2e-3, "rtol": 2e-3}}
SPLITK_SMALL = {"splitKMinContext": 64, "splitKMinChunk": 64}


def _r(seqs: list[list[int]], hq: int, hkv: int, d: int, seed: int, **extra: Any
       ) -> dict[str, Any]:
    return {"seqs": seqs, "num_heads": hq, "kv_num_heads": hkv, "head_size": d,
            "block_size": extra.pop("block_size", 16), "packed_qkv": False,
            "slot_mapping": "none", "shuffle_blocks": True, "spare_blocks": 2, "seed": seed,
            **extra}


TEST_CASES: list[dict[str, Any]] = [
    {"name": "several-sequences-gqa4-d64",
     "recipe": _r([[0, 5], [17, 3], [40, 1], [100, 2]], 8, 2, 64, 1)},
    {"name": "page-boundaries-gqa2-d64",
     "recipe": _r([[15, 1], [16, 1], [31, 2], [0, 16], [16, 17]], 4, 2, 64, 2)},
    {"name": "gqa1-d128", "recipe": _r([[20, 3], [0, 4]], 4, 4, 128, 3)},
    {"name": "gqa2-d64", "recipe": _r([[33, 2], [7, 5]], 4, 2, 64, 4)},
    {"name": "gqa8-d128", "recipe": _r([[50, 2], [0, 3]], 8, 1, 128, 5)},
    {"name": "packed-qkv-gqa4-d64",
     "recipe": _r([[10, 4], [0, 6]], 8, 2, 64, 6, packed_qkv=True)},
    {"name": "slot-mapping-derived", "recipe": _r([[16, 6], [3, 5]], 4, 2, 64, 7,
                                                   slot_mapping="derived")},
    {"name": "slot-mapping-skips-minus-one", "recipe": _r([[16, 6], [3, 5]], 4, 2, 64, 8,
                                                           slot_mapping="skip")},
    {"name": "packed-qkv-slot-skips-d128", "recipe": _r([[9, 4], [30, 2]], 4, 1, 128, 9,
                                                         packed_qkv=True, slot_mapping="skip")},
    {"name": "decode-splitk-gqa4-d128",
     "recipe": _r([[300, 1], [177, 1], [64, 1], [5, 1]], 8, 2, 128, 10),
     "tunables": SPLITK_SMALL, "expectVariant": "flash-decode-splitk"},
    {"name": "decode-splitk-packed-gqa8-d64",
     "recipe": _r([[250, 1], [31, 1]], 8, 1, 64, 11, packed_qkv=True),
     "tunables": SPLITK_SMALL, "expectVariant": "flash-decode-splitk-packed-qkv"},
    {"name": "decode-splitk-slot-skips-gqa2-d64",
     "recipe": _r([[200, 1], [96, 1], [17, 1]], 4, 2, 64, 12, slot_mapping="skip"),
     "tunables": SPLITK_SMALL, "expectVariant": "flash-decode-splitk"},
    {"name": "decode-short-context-tiled", "recipe": _r([[40, 1], [9, 1]], 8, 2, 64, 13),
     "expectVariant": "tiled"},
    {"name": "token-count-zero", "recipe": _r([[10, 0], [4, 0]], 4, 2, 64, 14)},
    {"name": "empty-sequences-in-batch",
     "recipe": _r([[10, 0], [5, 3], [0, 0], [9, 1]], 4, 1, 64, 15)},
    {"name": "block-size-32-explicit-scale",
     "recipe": _r([[40, 3], [70, 1]], 4, 2, 64, 16, block_size=32, scale=0.1)},
    {"name": "prefill-several-tiles-gqa4", "recipe": _r([[0, 40], [3, 21]], 4, 1, 64, 17)},
    {"name": "head-size-24-portable-body", "recipe": _r([[12, 3], [0, 5]], 4, 2, 24, 18)},
    {"name": "portable-body-decode-splitk", "recipe": _r([[130, 1], [77, 1]], 8, 2, 64, 19),
     "tunables": {**SPLITK_SMALL, "useSubgroups": 0}, "expectVariant": "flash-decode-splitk"},
    {"name": "portable-body-prefill-packed-skips",
     "recipe": _r([[5, 11], [20, 4]], 8, 4, 128, 21, packed_qkv=True, slot_mapping="skip"),
     "tunables": {"useSubgroups": 0}},
    # a block drafter's masks (DFlash2): a bidirectional block over its history, windows
    {"name": "bidirectional-block-gqa4-d64",
     "recipe": _r([[40, 16], [0, 16], [9, 5]], 8, 2, 64, 22, is_causal=0)},
    {"name": "bidirectional-block-window-portable",
     "recipe": _r([[70, 16], [3, 8]], 4, 2, 64, 23, is_causal=0, local_window_size=20),
     "tunables": {"useSubgroups": 0}},
    {"name": "local-window-prefill-gqa2-d128",
     "recipe": _r([[30, 12], [0, 40]], 4, 2, 128, 24, local_window_size=8)},
    {"name": "local-window-decode-splitk",
     "recipe": _r([[300, 1], [90, 1], [5, 1]], 8, 2, 64, 25, local_window_size=70),
     "tunables": SPLITK_SMALL, "expectVariant": "flash-decode-splitk"},
]

REJECTIONS: list[dict[str, Any]] = [
    {"name": "softcap-not-implemented", "edit": {"setAttrs": {"softcap": 1.0}},
     "error": "UnsupportedConfiguration"},
    {"name": "local-window-zero", "edit": {"setAttrs": {"local_window_size": 0}},
     "error": "ContractViolation"},
    {"name": "unknown-attribute", "edit": {"setAttrs": {"window": 3}},
     "error": "ContractViolation"},
    {"name": "missing-required-attribute", "edit": {"dropAttrs": ["kv_num_heads"]},
     "error": "ContractViolation"},
    {"name": "head-sink-port-not-implemented",
     "edit": {"bind": {"headSinkT": {"shape": [4], "dtype": "float16"}}},
     "error": "UnsupportedConfiguration"},
    {"name": "rotary-port-not-implemented",
     "edit": {"bind": {"cosCacheT": {"shape": [64, 16], "dtype": "float16"}}},
     "error": "UnsupportedConfiguration"},
    {"name": "unknown-port", "edit": {"bind": {"biasT": {"shape": [4], "dtype": "float16"}}},
     "error": "ContractViolation"},
    {"name": "missing-block-table", "edit": {"drop": ["blockTableT"]},
     "error": "ContractViolation"},
    {"name": "float32-query", "edit": {"cast": {"queryT": "float32", "keyT": "float32",
                                                "valueT": "float32"}},
     "error": "ContractViolation"},
    {"name": "int64-past-seqlens", "edit": {"cast": {"pastSeqlensT": "int64"}},
     "error": "ContractViolation"},
    {"name": "key-without-value", "edit": {"drop": ["valueT"]}, "error": "ContractViolation"},
]
_REJECTION_RECIPE = _r([[5, 2], [0, 3]], 4, 2, 64, 20)


def literal_case() -> dict[str, Any]:
    """A tiny self-contained case: inputs inline, expected outputs from the torch reference."""
    import torch

    from pagedhybrid.kernels.webgpu.cases import to_onnx_names
    from pagedhybrid.ops.paged_attention import SPEC, paged_attention

    recipe = _r([[3, 2], [17, 1]], 2, 1, 8, 30, spare_blocks=1)
    inputs, attrs = make_case(recipe)
    named = to_onnx_names(inputs)
    args = [torch.from_numpy(named[p.name].copy()) if p.name in named else None
            for p in SPEC.inputs]
    out, kc, vc = paged_attention(*args, **attrs)

    def enc(a: np.ndarray) -> dict[str, Any]:
        return {"shape": list(a.shape), "dtype": str(a.dtype),
                "data": [float(x) if a.dtype.kind == "f" else int(x) for x in a.reshape(-1)]}

    return {"name": "literal-two-sequences-d8", "attrs": attrs,
            "inputs": {k: enc(v) for k, v in inputs.items()},
            "expected": {"outputT": enc(out.numpy()), "keyCacheT": enc(kc.numpy()),
                         "valueCacheT": enc(vc.numpy())}}


def test_json() -> dict[str, Any]:
    return {
        "schema": "pagedhybrid/webgpu-kernel-tests@1 (project-defined, not upstream-verified)",
        "op": "com.microsoft.PagedAttention",
        "reference": REFERENCE,
        "recipeGenerator": "pagedhybrid.kernels.webgpu.cases.make_case "
                           "(numpy.random.default_rng(seed); see its docstring)",
        "tolerance": TOLERANCE,
        "cases": [*TEST_CASES, literal_case()],
        "rejections": [{**r, "recipe": _REJECTION_RECIPE} for r in REJECTIONS],
    }


def _b(name: str, kind: str, recipe: dict[str, Any], iters: int, **extra: Any
       ) -> dict[str, Any]:
    return {"name": name, "kind": kind, "recipe": recipe, "warmup": 2, "iters": iters, **extra}


BENCH_CASES: list[dict[str, Any]] = [
    _b("decode-b4-ctx512-gqa4-d128", "decode", _r([[512, 1]] * 4, 16, 4, 128, 100), 20),
    _b("decode-b4-ctx2048-gqa4-d128", "decode", _r([[2048, 1]] * 4, 16, 4, 128, 101), 10,
       tuning={"splitKMinChunk": [128, 256, 512], "keyChunk": [16, 32]}),
    _b("decode-b1-ctx4096-gqa8-d128", "decode", _r([[4096, 1]], 16, 2, 128, 102), 10),
    _b("decode-b8-ctx1024-gqa2-d64", "decode", _r([[1024, 1]] * 8, 8, 4, 64, 103), 10),
    _b("prefill-128-gqa4-d128", "prefill", _r([[0, 128]], 16, 4, 128, 104), 5,
       tuning={"subgroupRows": [4, 8], "useSubgroups": [0, 1], "keyChunk": [16, 32]}),
    _b("prefill-512-gqa4-d128", "prefill", _r([[0, 512]], 16, 4, 128, 105), 3),
    _b("mixed-b3-gqa4-d64", "mixed", _r([[300, 64], [1000, 1], [17, 33]], 8, 2, 64, 106), 5),
]


def bench_json() -> dict[str, Any]:
    return {
        "schema": "pagedhybrid/webgpu-kernel-bench@1 (project-defined, not upstream-verified)",
        "op": "com.microsoft.PagedAttention",
        "peer": "onnxruntime-ep-webgpu 0.4.0 PagedAttention (same adapter, IOBinding, caches "
                "resident and aliased)",
        "timing": "per call: upload of the small inputs, all passes, readback of outputT; "
                  "caches stay on the device. First call (shader compilation) reported apart.",
        "cases": BENCH_CASES,
    }
