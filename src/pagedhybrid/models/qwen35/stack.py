"""The model's whole decode step as one native call, where the bundle has one
(``Backend.fused.stack``, ``kernels/native/seam.py`` ``DecodeStack``): the embedding, every
decoder layer's fused call, the final norm and the LM head, bit for bit what
``forward_packed`` runs one call at a time (``tests/models/test_qwen35_packed.py``).

``bind_stack`` binds it to one cache's pools, or says why it does not apply: it needs a model of
dense layers on one rank whose full-attention pages are in the model dtype and a bundle that
fuses both kinds of layer (quantized pages, mixtures of experts, tensor parallelism and a bundle
without fused layers take the layers' path). The runner's graph executor
(``engine/worker/executors.py``) holds the binding and binds again when a parameter changes.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from pagedhybrid.kernels.registry import Backend
from pagedhybrid.models.qwen35.layers import SparseMoE
from pagedhybrid.models.qwen35.packed import PagedHybridCache


def bind_stack(backend: Backend, model: nn.Module, lm_head: nn.Module,
               cache: PagedHybridCache) -> tuple[Any | None, str]:
    """(``backend``'s ``DecodeStack`` of ``model`` (a ``Qwen35TextModel``) and ``lm_head`` over
    ``cache``, or None; why not, when None)."""
    layers = list(model.layers)
    if backend.fused is None:
        return None, f"the {backend.name} bundle has no fused whole step"
    bind = backend.fused.stack
    if cache.kv_scales:
        return None, "quantized KV pages"
    if not layers:
        return None, "no layers"
    embed = model.embed_tokens.weight
    if any(isinstance(layer.mlp, SparseMoE) for layer in layers):
        return None, "a mixture of experts"
    if len({id(layer.mlp.down_proj.matmul) for layer in layers}) != 1:
        return None, "the layers' products are in different forms"
    bound = []
    for layer in layers:
        i = layer.index
        if layer.is_full:
            pools = (cache.key_cache[i], cache.value_cache[i])
            if pools[0].dtype != embed.dtype:
                return None, "KV pages in another dtype than the model"
            checkpoints = (None, None)
        else:
            pools = (cache.conv_state[i], cache.recurrent_state[i])
            checkpoints = cache.checkpoint_pools(i) or (None, None)
        bound.append((layer.decode_weights(), pools, checkpoints))
    stack = bind(bound, embed, model.norm.weight, model.norm.eps, lm_head.weight, lm_head.quant,
                 layers[0].mlp.down_proj.matmul, lm_head.matmul)
    return stack, "" if stack is not None else "the layers' weights are in different formats"
