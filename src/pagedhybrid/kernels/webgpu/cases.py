"""Seeded PagedAttention cases: the recipe language of ``test.json`` and ``bench.json``.

A recipe is JSON-able::

    {"name": "decode-gqa4", "seqs": [[past, new], ...], "num_heads": 8, "kv_num_heads": 2,
     "head_size": 64, "block_size": 16, "packed_qkv": false, "slot_mapping": "none",
     "shuffle_blocks": true, "spare_blocks": 2, "scale": 0.0, "seed": 0}

(``is_causal`` and ``local_window_size``, when given, are passed as attributes too.)

``seqs`` lists each sequence's cached history length and this step's new-token count.
``slot_mapping`` is ``"none"`` (port absent, slots derived from ``past_seqlens``), ``"derived"``
(port present with the derived slots) or ``"skip"`` (every third token gets ``-1``, so its K/V
is not written). Blocks are handed out from a (seeded) shuffled pool, so block tables are
scattered; unused table entries are ``-1``. Every value comes from ``numpy.random.default_rng``
with the recipe seed, so a recipe is a complete, portable description of its inputs.

Arrays are keyed by the package's bind keys (``queryT``, ``keyCacheT``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

BIND_KEYS = {  # ONNX input name -> bind key
    "query": "queryT", "key": "keyT", "value": "valueT", "key_cache": "keyCacheT",
    "value_cache": "valueCacheT", "cumulative_sequence_length": "cumulativeSequenceLengthT",
    "past_seqlens": "pastSeqlensT", "block_table": "blockTableT", "slot_mapping": "slotMappingT",
}


def make_case(recipe: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The inputs (by bind key) and attributes a recipe describes."""
    rng = np.random.default_rng(int(recipe.get("seed", 0)))
    seqs = [(int(p), int(n)) for p, n in recipe["seqs"]]
    hq, hkv, d = int(recipe["num_heads"]), int(recipe["kv_num_heads"]), int(recipe["head_size"])
    bs = int(recipe.get("block_size", 16))
    totals = [p + n for p, n in seqs]
    need = [-(-t // bs) for t in totals]
    max_blocks = max([*need, 1])
    num_blocks = sum(need) + int(recipe.get("spare_blocks", 2))
    pool = np.arange(num_blocks)
    if recipe.get("shuffle_blocks", True):
        pool = rng.permutation(num_blocks)
    block_table = np.full((len(seqs), max_blocks), -1, np.int32)  # [B, M]
    nxt = 0
    for b, k in enumerate(need):
        block_table[b, :k] = pool[nxt: nxt + k]
        nxt += k
    n_tok = sum(n for _, n in seqs)
    cu = np.zeros(len(seqs) + 1, np.int32)
    cu[1:] = np.cumsum([n for _, n in seqs])
    past = np.array([p for p, _ in seqs], np.int32)

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    key_cache = randn(num_blocks, bs, hkv, d)  # [NB, bs, Hkv, D]; garbage past the histories
    value_cache = randn(num_blocks, bs, hkv, d)
    q = randn(n_tok, hq * d)
    k = randn(n_tok, hkv * d)
    v = randn(n_tok, hkv * d)
    inputs: dict[str, np.ndarray] = {}
    if recipe.get("packed_qkv", False):
        inputs["queryT"] = np.ascontiguousarray(np.concatenate([q, k, v], axis=1))
    else:
        inputs.update(queryT=q, keyT=k, valueT=v)
    inputs.update(keyCacheT=key_cache, valueCacheT=value_cache, cumulativeSequenceLengthT=cu,
                  pastSeqlensT=past, blockTableT=block_table)
    mode = recipe.get("slot_mapping", "none")
    if mode != "none":
        slots = np.empty(n_tok, np.int32)
        for b, (p, n) in enumerate(seqs):
            for i in range(n):
                pos = p + i
                slots[cu[b] + i] = block_table[b, pos // bs] * bs + pos % bs
        if mode == "skip":
            slots[::3] = -1
        inputs["slotMappingT"] = slots
    attrs: dict[str, Any] = {"num_heads": hq, "kv_num_heads": hkv}
    if "scale" in recipe:
        attrs["scale"] = float(recipe["scale"])
    for name in ("is_causal", "local_window_size"):
        if name in recipe:
            attrs[name] = int(recipe[name])
    return inputs, attrs


def to_onnx_names(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Bind-keyed arrays renamed to ONNX Runtime's input names."""
    inv = {v: k for k, v in BIND_KEYS.items()}
    return {inv[k]: v for k, v in inputs.items()}
