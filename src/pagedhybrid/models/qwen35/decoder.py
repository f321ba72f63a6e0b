"""The decoder stack's modules (HF ``Qwen3_5ForCausalLM``'s ``model``): ``DecoderLayer`` -- a
pre-norm residual layer whose mixer is ``FullAttention`` or ``GatedDeltaNet`` by ``layer_types``,
with its tensors gathered for a bundle's fused decode layer (``decode_weights``, ``fused_why_not``,
``fused_forward``) -- ``Qwen35TextModel`` (embedding, layers, final norm) and the checkpoint's
``MtpHead``; ``model.Qwen35ForCausalLM`` runs them.

A layer's order of operations is its kind's program (``kernels/layer_spec.py``), declared once:
``DecoderLayer.forward`` runs it with ``LAYER_OPS`` (each op one module call), the fused layer
(``decode_layer.cpp``) with a native call per op. What differs between a packed paged step and
the dense path is only where the mixers' state lives: a ``PackedStep`` or a ``DenseStep``
(``attend`` and ``mix``).

``PARAMETER_EPOCH`` counts parameter registrations: what is gathered from the modules for the
native calls (a layer's weights, ``stack.bind_stack``'s binding) is reused while it is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedhybrid.kernels.backend import Backend
from pagedhybrid.kernels.layer_spec import (
    ATTENTION,
    GDN,
    PROJECTION,
    LayerSpec,
    LayerWeights,
    Op,
    resolve,
)
from pagedhybrid.kernels.step import MtpHeadInput, StepMetadata
from pagedhybrid.models.qwen35.attention import FullAttention
from pagedhybrid.models.qwen35.config import FULL_ATTENTION, Qwen35Config
from pagedhybrid.models.qwen35.layers import MLP, OffsetRMSNorm, SparseMoE
from pagedhybrid.models.qwen35.linear_attention import QK_L2_NORM_EPS, GatedDeltaNet
from pagedhybrid.models.qwen35.packed import PagedHybridCache
from pagedhybrid.parallel.linear import ParallelConfig, ReplicatedLinear

# Bumped whenever any module registers a parameter (``setattr`` of an ``nn.Parameter``, as
# ``load_weights`` adopts them): a layer's gathered weights for the fused decode ops are reused
# only while no parameter object was replaced (in-place updates change nothing they refer to).
PARAMETER_EPOCH = [0]


def _parameter_registered(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    PARAMETER_EPOCH[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_parameter_registered)


class PackedStep(NamedTuple):
    """A packed paged step, as each layer's mixer op reads it: the rope rows, the step's
    metadata, the cache (pages, state pools, checkpoints, capsules) and the bundle."""

    cos: torch.Tensor
    sin: torch.Tensor
    meta: StepMetadata
    cache: PagedHybridCache
    backend: Backend

    def attend(self, layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        i, c = layer.index, self.cache
        return layer.self_attn.attend(q, k, v, self.cos, self.sin, self.meta, c.key_cache[i],
                                      c.value_cache[i], self.backend, c.kv_scales.get(i))

    def mix(self, layer: DecoderLayer, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor,
            b: torch.Tensor) -> torch.Tensor:
        i, c = layer.index, self.cache
        return layer.linear_attn.mix(qkv, z, a, b, self.meta, c.conv_state[i],
                                     c.recurrent_state[i], self.backend, c.checkpoint_pools(i),
                                     c.capsules.get(i))


class DenseStep(NamedTuple):
    """A dense step of ``batch`` rows of ``S`` tokens: the past keys / values of each full layer
    (``past_keys`` / ``past_values``, None at the start) and where this step's go (``keys`` /
    ``values``), each linear layer's conv / recurrent state (advanced in place)."""

    cos: torch.Tensor
    sin: torch.Tensor
    meta: StepMetadata
    batch: int
    past_keys: dict[int, torch.Tensor | None]
    past_values: dict[int, torch.Tensor | None]
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    backend: Backend

    def attend(self, layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        i = layer.index
        out, self.keys[i], self.values[i] = layer.self_attn.attend_dense(
            q, k, v, self.cos, self.sin, self.batch, self.past_keys.get(i),
            self.past_values.get(i))
        return out

    def mix(self, layer: DecoderLayer, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor,
            b: torch.Tensor) -> torch.Tensor:
        i = layer.index
        return layer.linear_attn.mix(qkv, z, a, b, self.meta, self.conv[i], self.recurrent[i],
                                     self.backend)


Step = PackedStep | DenseStep


def _module(layer: DecoderLayer, field: str) -> Any:
    """The module of ``layer`` that holds ``field``: a projection's own, a weight's owner."""
    f = layer.spec.field(field)
    return layer.get_submodule(f.source if f.kind == PROJECTION else f.source.rpartition(".")[0])


# The modules' implementation of each op of a program (layer_spec.OPS): (layer, step, the
# modules the op's fields name -- resolved once per layer for the ops in CALLS_FIELDS --, its
# input registers) -> its output register (a tuple of them where it writes several).
LAYER_OPS: dict[str, Callable[..., Any]] = {
    "norm": lambda layer, step, mods, x: mods[0](x),
    "project": lambda layer, step, mods, x: (
        mods[0](x) if len(mods) == 1 else tuple(m(x) for m in mods)),
    "gdn_mixer": lambda layer, step, mods, qkv, z, a, b: step.mix(layer, qkv, z, a, b),
    "attend": lambda layer, step, mods, q, k, v: step.attend(layer, q, k, v),
    "add": lambda layer, step, mods, a, b: a + b,
    "mlp": lambda layer, step, mods, x: layer.mlp(x),  # a mixture of experts too
}
CALLS_FIELDS = {"norm": 1, "project": None}  # ops that call the modules of their fields (how many)


class DecoderLayer(nn.Module):
    l2_eps = QK_L2_NORM_EPS  # the Gated DeltaNet's q / k L2 norm (its fused op's ``l2_eps``)

    def __init__(self, config: Qwen35Config, index: int, dtype: torch.dtype,
                 parallel: ParallelConfig, full: bool | None = None) -> None:
        """Layer ``index`` of the stack (its kind from ``config.layer_types``), or, with
        ``full``, a layer of that kind whose cache pools are those of ``index`` (the MTP
        head's full-attention layer, past the stack)."""
        super().__init__()
        self._weights: tuple[int, LayerWeights] | None = None
        self._bound: tuple[LayerSpec, list[tuple[Op, tuple[Any, ...]]]] | None = None
        self.index = index
        self.is_full = config.layer_types[index] == FULL_ATTENTION if full is None else full
        if self.is_full:
            self.self_attn = FullAttention(config, dtype, parallel)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype, parallel)
        self.mlp: MLP | SparseMoE = SparseMoE(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.shared_expert_intermediate_size, dtype,
            parallel) if config.is_moe else MLP(config.hidden_size, config.intermediate_size,
                                                dtype, parallel)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                      dtype)

    @property
    def spec(self) -> LayerSpec:
        return ATTENTION if self.is_full else GDN

    def forward(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """``h [T, hidden]`` after this layer: its kind's program, one module call an op."""
        regs = {"h": h}
        for op, mods in self._program():
            out = LAYER_OPS[op.op](self, step, mods, *[regs[r] for r in op.ins])
            if len(op.outs) == 1:
                regs[op.outs[0]] = out
            else:
                regs.update(zip(op.outs, out, strict=True))
        return regs["h"]

    def _program(self) -> list[tuple[Op, tuple[Any, ...]]]:
        """The program's ops with the modules they call, resolved once per program."""
        spec = self.spec
        if self._bound is None or self._bound[0] is not spec:
            self._bound = (spec, [
                (op, tuple(_module(self, f) for f in op.fields[:CALLS_FIELDS[op.op]])
                 if op.op in CALLS_FIELDS else ()) for op in spec.program])
        return self._bound[1]

    def decode_weights(self) -> LayerWeights:
        """This layer's fields for a bundle's ``gdn_decode_layer`` / ``attention_decode_layer``
        (``kernels/layer_spec.py``: the parameters themselves; gathered once while no parameter
        is replaced)."""
        cached = self._weights
        if cached is not None and cached[0] == PARAMETER_EPOCH[0]:
            return cached[1]
        w = resolve(self.spec, self)
        self._weights = (PARAMETER_EPOCH[0], w)
        return w

    def fused_why_not(self, backend: Backend, cache: PagedHybridCache) -> str | None:
        """Why this layer has no fused call (``Backend.fused``) over ``cache`` -- the bundle has
        none, its feed-forward is a mixture of experts, its pages are quantized or in another
        dtype than the model; None: it has one (each step is then asked ``fused.why_not``)."""
        if backend.fused is None:
            return f"the {backend.name} bundle has no fused layers"
        if isinstance(self.mlp, SparseMoE):
            return "a mixture of experts"
        if self.is_full and cache.kv_scales.get(self.index) is not None:
            return "quantized KV pages"
        if self.is_full and cache.key_cache[self.index].dtype != self.input_layernorm.weight.dtype:
            return "KV pages in another dtype than the model"
        return None

    def product(self) -> tuple[Any, bool]:
        """How the fused call multiplies: the layer's product (``matmul``) and whether its
        weights are int8 / int4 -- what ``fused.why_not`` asks about at a step's rows."""
        return self.mlp.down_proj.matmul, bool(self.decode_weights().quant)

    def fused_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: PagedHybridCache, meta: StepMetadata, backend: Backend
                      ) -> torch.Tensor:
        """``h`` after this layer in one call of the bundle's fused layer, for a layer with one
        (``fused_why_not``) and a step the bundle takes (``fused.why_not``): the runner's layers
        executor asks both before it runs a step this way."""
        fused = backend.fused
        assert fused is not None
        i, matmul = self.index, self.mlp.down_proj.matmul
        if self.is_full:
            return fused.attention_layer(
                h, self.decode_weights(), cos, sin, cache.key_cache[i], cache.value_cache[i],
                meta, matmul, cache.kv_scales.get(i))
        return fused.gdn_layer(
            h, self.decode_weights(), cache.conv_state[i], cache.recurrent_state[i], meta,
            matmul, cache.checkpoint_pools(i) or (None, None), cache.capsules.get(i))

    def head_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: PagedHybridCache, meta: StepMetadata, backend: Backend,
                     fuse: bool = True) -> torch.Tensor:
        """The MTP head's layer (full attention) over a head step: one fused call where
        ``fuse`` (one rank), the layer has one and the bundle takes the step, else its
        modules."""
        fused = backend.fused
        if (not fuse or fused is None or self.fused_why_not(backend, cache) is not None
                or fused.why_not(meta, h.shape[0], h.dtype, *self.product()) is not None):
            return self(h, PackedStep(cos, sin, meta, cache, backend))
        return self.fused_forward(h, cos, sin, cache, meta, backend)


class Qwen35TextModel(nn.Module):
    def __init__(self, config: Qwen35Config, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class MtpHead(nn.Module):
    """The checkpoint's multi-token-prediction head (``mtp.*``; vLLM's ``Qwen3_5MTP``): from the
    main model's final-norm hidden ``h_p`` at position ``p`` and the token ``t_{p+1}`` after
    it, ``fc(cat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))`` goes
    through one full-attention decoder layer at position ``p`` (its K/V in its own pool, layer
    index ``num_hidden_layers``, on the sequence's pages) and ``norm``: a hidden whose LM-head
    logits predict ``t_{p+2}`` and which takes ``h``'s place in the next step of a chain.
    Embedding and LM head are the main model's."""

    def __init__(self, config: Qwen35Config, dtype: torch.dtype,
                 parallel: ParallelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ReplicatedLinear(2 * h, h, dtype)
        self.layers = nn.ModuleList([DecoderLayer(config, config.num_hidden_layers, dtype,
                                                  parallel, full=True)])
        self.norm = OffsetRMSNorm(h, eps, dtype)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps, dtype)
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps, dtype)

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]  # type: ignore[return-value]

    def input_weights(self, embed: torch.Tensor) -> MtpHeadInput:
        """What the fused head kernels read before the layer (``embed``: the model's table)."""
        return MtpHeadInput(embed, self.pre_fc_norm_embedding.weight,
                            self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps,
                            self.fc.weight, self.fc.quant)
