"""A decode step's whole stack in one native call, where the bundle has one
(``Backend.decode_stack``, ``kernels/native/step.py`` ``DecodeStack``): the embedding, every
decoder layer's fused call, the final norm and the LM head, bit for bit what
``forward_packed`` runs one call at a time (``tests/models/test_qwen35_packed.py``).

It applies to a model of dense layers on one rank whose full-attention pages are in the model
dtype, with a bundle that fuses both kinds of layer (quantized pages, mixtures of experts,
tensor parallelism and a bundle without fused layers take the layers' path), bound to one
cache's pools; the model binds again when a parameter, the bundle or the cache changes.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from pagedhybrid.kernels.registry import Backend
from pagedhybrid.models.qwen35.layers import SparseMoE
from pagedhybrid.models.qwen35.packed import PagedHybridCache


def bind_stack(backend: Backend, model: nn.Module, lm_head: nn.Module,
               cache: PagedHybridCache) -> Any | None:
    """``backend``'s ``DecodeStack`` of ``model`` (a ``Qwen35TextModel``) and ``lm_head`` over
    ``cache``, or None where it does not apply."""
    bind = backend.decode_stack
    layers = list(model.layers)
    if (bind is None or backend.gdn_decode_layer is None
            or backend.attention_decode_layer is None or cache.kv_scales or not layers):
        return None
    embed = model.embed_tokens.weight
    if any(isinstance(layer.mlp, SparseMoE) for layer in layers) or len(
            {id(layer.mlp.down_proj.matmul) for layer in layers}) != 1:
        return None  # experts (as DecoderLayer.fused_decode), or products in different forms
    bound = []
    for layer in layers:
        i = layer.index
        if layer.is_full:
            pools = (cache.key_cache[i], cache.value_cache[i])
            if pools[0].dtype != embed.dtype:
                return None
            checkpoints = (None, None)
        else:
            pools = (cache.conv_state[i], cache.recurrent_state[i])
            checkpoints = cache.checkpoint_pools(i) or (None, None)
        bound.append((layer.decode_weights(), pools, checkpoints))
    return bind(bound, embed, model.norm.weight, model.norm.eps, lm_head.weight, lm_head.quant,
                layers[0].mlp.down_proj.matmul, lm_head.matmul)
