"""The native kernels behind the model's step seam (torch kernels for what they do not cover).

* attention -- the step's K/V written at ``meta.write_slots``; sequences with at most
  ``MAX_NATIVE_QUERY`` new tokens (decode, short continuations) run the native paged kernel in
  place over their pages; longer prefill chunks (compute-bound, GEMM-shaped) run the torch
  per-sequence SDPA path.
* causal conv / gated delta -- decode sequences are updated in place in their pool rows by the
  native kernels (a fresh sequence reads zeros, its row is only written); the conv of chunks of
  at most ``MAX_NATIVE_QUERY`` tokens runs the same per-token kernel (``conv_varlen``); longer
  chunks run the torch stream conv, and every chunk the chunked WY form, on their pool rows.
Mixed steps split by sequence; rows of the two groups are disjoint, so they never interact.
* gdn_decode -- a step of decode sequences (and verify chunks, captured) only: the whole Gated
  DeltaNet mixer between the
  input projections and ``out_proj`` (conv + SiLU, q / k L2 norms, the recurrent step, the gated
  RMS norm) in one native call, bit for bit what the separate kernels above and the native
  norms compute in turn (``csrc/gdn_mixer.cpp`` ``gdn_decode_mixer``; the projections may
  be row views); other steps return None and the layer runs them op by op.
* gdn_decode_layer -- a whole Gated DeltaNet decoder layer (norms, projections, the mixer, the
  residuals and the MLP) of a decode-only step in one native call (``csrc/decode_layer.cpp``),
  bit for bit the layer's modules when the bundle's products at this batch are the native
  ``linear`` kernel or torch's GEMM (``dense.product_form``), for a step ``layers_why_not``
  accepts (the runner's layers executor asks it first).
* attention_decode_layer -- the same for a full-attention layer over pages in the model dtype
  (quantized pages are never given to it).
* mtp_head_input / mtp_head_output -- the MTP head's input before its decoder layer (embedding,
  its two norms, ``fc``) and, for the drafter, what comes after it (the final norm, the LM head
  of the rows it drafts from and their greedy pick), one call each; mtp_chain -- the drafter's
  whole chain of one-token head steps in one call; mtp_draft -- its catch-up and chain.
* DecodeStack -- a whole decode-only step of the model in one call: the embedding, every
  layer's fused call, the final norm and the LM head, bound once to the layers' tensors and
  the cache's pools (``models/qwen35/stack.py`` binds it).
``FUSED`` / ``MTP`` are the native bundle's ``FusedDecode`` / ``MtpKernels``.
* CAPTURE -- a speculative verify step's recurrent state (``kernels/capsule.py``): the verify
  sequences' tokens through the per-token kernel on copies of their rows, capturing decay, key
  and delta (``gated_delta_capture``), and the accepted tokens replayed into the rows
  (``gated_delta_replay``), each bit for bit what the in-place kernels compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pagedhybrid.kernels.capsule import Capsule, StateCapture
from pagedhybrid.kernels.cpu import seam as torch_seam
from pagedhybrid.kernels.layer_spec import GDN, POOL, LayerWeights
from pagedhybrid.kernels.native import KV_SPLIT, classes, dense, library
from pagedhybrid.kernels.native import quant as native_quant
from pagedhybrid.kernels.registry import FusedDecode, MtpKernels
from pagedhybrid.kernels.step import MtpHeadInput, StepMetadata, quant_tensors
from pagedhybrid.kvquant import KVScales
from pagedhybrid.weightquant import QuantizedWeight

MAX_NATIVE_QUERY = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, meta: StepMetadata, scale: float,
              scales: KVScales | None = None, max_query: int = MAX_NATIVE_QUERY
              ) -> torch.Tensor:
    """Sequences with at most ``max_query`` new tokens on the native kernel, longer ones on the
    torch SDPA path."""
    torch_seam.write_kv(k, v, key_cache, value_cache, meta, scales)
    short = meta.memo(f"native_short{max_query}", lambda: tuple(
        b for b in range(meta.batch) if 0 < meta.q_lens[b] <= max_query))
    long_ = tuple(b for b in range(meta.batch) if meta.q_lens[b] > max_query)
    n, hq, d = q.shape
    qf, vs, adt = torch_seam.folded_query(q, key_cache, scales)  # int8 / fp8: scales folded
    out = (torch.empty(n, hq, d, dtype=torch.float32) if not long_ else
           torch_seam.attend(qf.to(adt), key_cache, value_cache, meta, scale, long_, adt))
    if short:
        library().paged_attention(qf.contiguous(), key_cache, value_cache,  # type: ignore[attr-defined]
                              meta.block_table, meta.cu_seqlens_t, meta.past_t,
                              meta.seq_index(short), out, scale, KV_SPLIT)
    if vs is not None:
        out *= vs
    return out.to(q.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    silu = activation in ("silu", "swish")
    w = weight.view(weight.shape[0], weight.shape[-1])  # [C, K] (a view: [C, 1, K] contiguous)
    if meta.all_decode:
        y = torch.empty_like(x)
        library().causal_conv_decode(x.contiguous(), w, None, pool, meta.state_slots,  # type: ignore[attr-defined]
                                     meta.fresh_t, y, silu)
        torch_seam.save_chunk_ends(pool, checkpoints, meta)
        return y
    y = torch.empty_like(x)
    if meta.decode:
        rows, sub = meta.subset(meta.decode)
        yd = torch.empty(rows.numel(), x.shape[1], dtype=x.dtype)
        library().causal_conv_decode(x.index_select(0, rows), w, None, pool, sub.state_slots,  # type: ignore[attr-defined]
                                     sub.fresh_t, yd, silu)
        torch_seam.save_chunk_ends(pool, checkpoints, sub)
        y.index_copy_(0, rows, yd)
    short = meta.memo("conv_short", lambda: tuple(
        b for b in meta.multi if meta.q_lens[b] <= MAX_NATIVE_QUERY))
    for group, conv in ((short, conv_varlen), (tuple(b for b in meta.multi if b not in short),
                                               torch_seam.conv_sequences)):
        if group:
            rows, sub = meta.subset(group)
            y.index_copy_(0, rows, conv(x.index_select(0, rows), weight, pool, sub, activation,
                                        checkpoints))
    return y


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, meta: StepMetadata,
                activation: str, checkpoints: torch.Tensor | None = None) -> torch.Tensor:
    """Every token of every sequence through the decode kernel's per-token conv, in place
    (``causal_conv_varlen``); checkpoints inside a chunk are copied from the inputs."""
    silu = activation in ("silu", "swish")
    w = weight.view(weight.shape[0], weight.shape[-1])  # [C, K]
    x = x.contiguous()
    init = (torch_seam.initial_conv_rows(pool, meta)
            if checkpoints is not None and torch_seam.inner_checkpoints(meta) else None)
    y = torch.empty_like(x)
    library().causal_conv_varlen(x, w, None, pool, meta.state_slots, meta.fresh_t,  # type: ignore[attr-defined]
                                 meta.cu_seqlens_t, y, silu)
    if init is not None:
        torch_seam.save_inner_conv_checkpoints(x, init, meta, checkpoints)
    torch_seam.save_chunk_ends(pool, checkpoints, meta)
    return y


FUSED_DTYPES = (torch.float32, torch.bfloat16)


def layers_why_not(meta: StepMetadata, rows: int, dtype: torch.dtype,
                   matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                   quantized: bool) -> str | None:
    """Why the fused decoder layers do not take a step of ``rows`` token rows whose products
    are ``matmul``'s (int8 / int4 weights: ``quant.linear``'s) in ``dtype``; None: they do."""
    if not meta.decode_or_verify:
        return "prefill chunks in the step"
    if dtype not in FUSED_DTYPES:
        return f"{dtype} is not a fused dtype"
    if _product_flag(rows, dtype, matmul, quantized) is None:
        return f"the products at {rows} rows are in a form the layers do not fuse"
    return None


def _native_product(h: torch.Tensor, meta: StepMetadata,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                    quantized: bool = False) -> bool:
    """Whether a fused decode layer multiplies with the native kernel (True) or torch's GEMM
    (False), as ``matmul`` does at this batch, on a step ``layers_why_not`` accepts."""
    flag = _product_flag(h.shape[0], h.dtype, matmul, quantized)
    assert meta.decode_or_verify and flag is not None, "layers_why_not"
    return flag


def _product_flag(rows: int, dtype: torch.dtype,
                  matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                  quantized: bool) -> bool | None:
    """How a fused call multiplies ``rows`` rows in ``dtype`` as ``matmul`` does: the native
    kernel (True), torch's GEMM (False), or a form it does not fuse (None)."""
    if dtype not in FUSED_DTYPES:
        return None
    if quantized:  # the integer kernel, as quant.linear below its prefill form
        return True if rows < native_quant.DEQUANT_ROWS else None
    return {"native": True, "torch": False}.get(dense.product_form(matmul, dtype, rows))


def _save_chunk_ends(conv_pool: torch.Tensor, pool: torch.Tensor,
                     checkpoints: tuple[torch.Tensor | None, torch.Tensor | None],
                     meta: StepMetadata) -> None:
    torch_seam.save_chunk_ends(conv_pool, checkpoints[0], meta)
    torch_seam.save_chunk_ends(pool, checkpoints[1], meta)


def _chunks(meta: StepMetadata, capsule: Capsule | None) -> dict[str, torch.Tensor] | None:
    """The fused mixer's arguments for a step of decodes and verify chunks ({} for a
    decode-only step); None when it cannot fuse the step."""
    if meta.all_decode:
        return {}
    if not meta.decode_or_verify or capsule is None:
        return None
    return {"cu_seqlens": meta.cu_seqlens_t, "verify": meta.verify_mask,
            "capsule_conv": capsule.conv, "decay": capsule.decay, "key": capsule.key,
            "delta": capsule.delta}


def gdn_decode(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               conv_weight: torch.Tensor, conv_pool: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, pool: torch.Tensor, norm_weight: torch.Tensor,
               meta: StepMetadata, key_heads: int, scale: float, l2_eps: float, norm_eps: float,
               checkpoints: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
               capsule: Capsule | None = None) -> torch.Tensor | None:
    """The gated-norm output ``[N, Hv·Dv]`` (model dtype) of a step of decodes (and verify
    chunks, captured into ``capsule``) from the layer's projections ``qkv [N, C]``,
    ``z [N, Hv·Dv]``, ``a``, ``b [N, Hv]`` (row views are fine), the decoding sequences' conv and
    recurrent rows advanced in place and the step's chunk-end checkpoints written; None when the
    step has other chunks or the dtype is not fused (float32, bfloat16)."""
    chunks = _chunks(meta, capsule)
    if chunks is None or qkv.dtype not in FUSED_DTYPES or z.dtype != qkv.dtype:
        return None
    out = torch.empty(qkv.shape[0], z.shape[-1], dtype=qkv.dtype)
    library().gdn_decode_mixer(qkv, z, a, b, conv_weight.view(conv_weight.shape[0], -1),  # type: ignore[attr-defined]
                               conv_pool, a_log, dt_bias, pool, meta.state_slots, meta.fresh_t,
                               norm_weight, out, key_heads, scale, l2_eps, norm_eps, **chunks)
    _save_chunk_ends(conv_pool, pool, checkpoints, meta)
    return out


@functools.cache
def _arguments(op: str) -> tuple[tuple[str, bool, Any], ...]:
    """(name, has a default, the default) of each argument of the native op ``op``, in its
    schema's order."""
    return tuple((a.name, a.has_default_value(), a.default_value)
                 for a in getattr(library(), op).default._schema.arguments)


def _call(op: str, values: Mapping[str, Any]) -> Any:
    """The native op ``op`` with its arguments ``values`` by name, passed in the schema's order
    (an absent one with a default takes it): the fused layers' fields are named by
    ``kernels/layer_spec.py``, and torch's own keyword binding costs ~5 us a call, once per
    layer of every fused step."""
    return getattr(library(), op)(*[values[n] if n in values or not has else default
                                    for n, has, default in _arguments(op)])


def gdn_decode_layer(h: torch.Tensor, w: LayerWeights, conv_pool: torch.Tensor,
                     pool: torch.Tensor, meta: StepMetadata,
                     matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                     checkpoints: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                     capsule: Capsule | None = None) -> torch.Tensor:
    """The residual stream ``[N, hidden]`` after the whole layer for a step of decodes (and
    verify chunks, captured into ``capsule``; their rows unchanged) -- the pools advanced in
    place, chunk-end checkpoints written -- computed as the layer's modules do with ``matmul``,
    for a step ``layers_why_not`` accepts."""
    native = _native_product(h, meta, matmul, bool(w.quant))
    chunks = _chunks(meta, capsule)
    assert chunks is not None, "verify chunks need the layer's capsule"
    out = _call("gdn_decode_layer", dict(
        w.args, h=h, conv_pool=conv_pool, pool=pool, slots=meta.state_slots, fresh=meta.fresh_t,
        native_linear=native, quant=w.quant, quant_bits=w.quant_bits, **chunks))
    _save_chunk_ends(conv_pool, pool, checkpoints, meta)
    return out


def attention_decode_layer(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor,
                           sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           meta: StepMetadata,
                           matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                           scales: KVScales | None = None) -> torch.Tensor:
    """The residual stream ``[N, hidden]`` after the whole layer for a step of decodes and
    verify chunks (the step's K/V written to their pages), computed as the layer's modules do
    with ``matmul``, for a step ``layers_why_not`` accepts over pages in the model dtype (not
    quantized)."""
    native = _native_product(h, meta, matmul, bool(w.quant))
    assert scales is None and key_cache.dtype == h.dtype, "pages in the model dtype"
    assert meta.write_slots is not None
    return _call("attention_decode_layer", dict(  # type: ignore[no-any-return]
        w.args, h=h, cos=cos, sin=sin, key_cache=key_cache, value_cache=value_cache,
        write_slots=meta.write_slots, block_table=meta.block_table,
        cu_seqlens=meta.cu_seqlens_t, past_lens=meta.past_t,
        seqs=meta.seq_index(tuple(range(meta.batch))), split=KV_SPLIT, native_linear=native,
        quant=w.quant, quant_bits=w.quant_bits))


def _held(weight: torch.Tensor, quant: QuantizedWeight | None
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int]:
    """One projection as the fused kernels take it: its weight, no quantised tensors and 0
    bits -- or, held in 8 / 4 bits, its codes in the weight's place with ``quant_tensors``'
    (codes, scales, zeros) and bits."""
    if quant is None:
        return weight, (), 0
    tensors, bits = quant_tensors([quant])
    return quant.codes, tensors, bits


def mtp_head_input(token_ids: torch.Tensor, hidden: torch.Tensor, w: MtpHeadInput,
                   meta: StepMetadata,
                   matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                   ) -> torch.Tensor | None:
    """The MTP head's decoder-layer input ``fc([norm(embed[token_ids]) | norm(hidden)])``
    ``[N, hidden]`` in one call (``model.MtpHead``), as the modules compute it with ``matmul``;
    None where the head's layer would not fuse the step either (``attention_decode_layer``)."""
    native = _product_flag(hidden.shape[0], hidden.dtype, matmul, w.fc_quant is not None)
    if not meta.decode_or_verify or native is None or w.embed.dtype != hidden.dtype:
        return None
    fc, quant, bits = _held(w.fc, w.fc_quant)
    return library().mtp_head_input(  # type: ignore[attr-defined]
        token_ids, hidden, w.embed, w.norm_embedding, w.norm_hidden, fc, w.eps, native, quant,
        bits)


def mtp_head_output(h: torch.Tensor, norm: torch.Tensor, eps: float,
                    picks: torch.Tensor | None, lm_head: torch.Tensor,
                    lm_quant: QuantizedWeight | None,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MTP head after its layer for a greedy drafter, in one call: (its hidden
    ``norm(h)`` ``[N, hidden]``, the first maximum of the LM-head logits of rows ``picks``
    (all when None) int64 ``[R]``, -1 for a row with a NaN or an infinity), as the modules and
    ``argmax`` compute them with ``matmul`` (``lm_quant``: the head's int8 / int4 form); None
    for a product form it does not fuse."""
    rows = h.shape[0] if picks is None else picks.shape[0]
    native = _product_flag(rows, h.dtype, matmul, lm_quant is not None)
    if native is None or not h.is_contiguous():
        return None
    lm, quant, bits = _held(lm_head, lm_quant)
    return library().mtp_head_output(  # type: ignore[attr-defined,no-any-return]
        h, norm, eps, picks, lm, native, quant, bits)


def _head_args(head_input: MtpHeadInput, layer: LayerWeights, key_cache: torch.Tensor,
               value_cache: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
               lm_quant: QuantizedWeight | None, native: bool) -> dict[str, object]:
    """The head's part of ``mtp_chain`` / ``mtp_draft``'s arguments, by name."""
    fc, fc_quant, _ = _held(head_input.fc, head_input.fc_quant)
    lm, lm_tensors, _ = _held(lm_head, lm_quant)
    return dict(layer.args, embed=head_input.embed, norm_embedding=head_input.norm_embedding,
                norm_hidden=head_input.norm_hidden, fc=fc, fc_quant=fc_quant,
                key_cache=key_cache, value_cache=value_cache, split=KV_SPLIT, quant=layer.quant,
                final_norm=final_norm, lm_head=lm, lm_quant=lm_tensors,
                quant_bits=layer.quant_bits, native_linear=native)


def _head_flag(rows: int, hidden: torch.Tensor, layer: LayerWeights,
               key_cache: torch.Tensor,
               matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
               ) -> bool | None:
    if key_cache.dtype != hidden.dtype or not hidden.is_contiguous():
        return None
    return _product_flag(rows, hidden.dtype, matmul, bool(layer.quant))


def mtp_chain(token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              steps: torch.Tensor, block_table: torch.Tensor, block_size: int,
              rope: tuple[torch.Tensor, torch.Tensor], head_input: MtpHeadInput,
              layer: LayerWeights, key_cache: torch.Tensor, value_cache: torch.Tensor,
              final_norm: torch.Tensor, lm_head: torch.Tensor, lm_quant: QuantizedWeight | None,
              matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MTP drafter's chain in one call (``csrc/mtp_head.cpp`` ``mtp_chain``: each
    step ``mtp_head_input``, the head's ``attention_decode_layer`` and ``mtp_head_output``):
    (drafts int64 ``[B, max(steps)]``, -1 past each chain's end; the head's hidden after each
    chain ``[B, hidden]``); None where a step would not fuse (quantized pages, a product form it
    does not take at ``B`` rows)."""
    native = _head_flag(hidden.shape[0], hidden, layer, key_cache, matmul)
    if native is None:
        return None
    return library().mtp_chain(  # type: ignore[attr-defined,no-any-return]
        token_ids, hidden, positions, steps, block_table, block_size, *rope,
        **_head_args(head_input, layer, key_cache, value_cache, final_norm, lm_head, lm_quant,
                     native))


def mtp_draft(token_ids: torch.Tensor, hidden: torch.Tensor, q_lens: torch.Tensor,
              past_lens: torch.Tensor, catch_table: torch.Tensor, picks: torch.Tensor,
              positions: torch.Tensor, steps: torch.Tensor, block_table: torch.Tensor,
              block_size: int, rope: tuple[torch.Tensor, torch.Tensor],
              head_input: MtpHeadInput, layer: LayerWeights, key_cache: torch.Tensor,
              value_cache: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
              lm_quant: QuantizedWeight | None,
              matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MTP drafter's step in one call (``mtp_draft``): the catch-up over the last step's
    committed rows (``q_lens`` / ``past_lens`` / ``catch_table`` per sequence), its picks at rows
    ``picks`` the first drafts, then ``mtp_chain`` from there: (drafts int64
    ``[D, 1 + max(steps)]``, -1 past each one's end; the head's hidden after each chain); None
    where it would not fuse (as ``mtp_chain``; the products' form taken at the catch-up's
    rows)."""
    native = _head_flag(hidden.shape[0], hidden, layer, key_cache, matmul)
    if native is None:
        return None
    return library().mtp_draft(  # type: ignore[attr-defined,no-any-return]
        token_ids, hidden, q_lens, past_lens, catch_table, picks, positions, steps, block_table,
        block_size, *rope, **_head_args(head_input, layer, key_cache, value_cache, final_norm,
                                        lm_head, lm_quant, native))


class DecodeStack:
    """A model's decode step in one native call (``csrc/decode_stack.cpp`` ``DecodeStack``):
    the embedding, every layer's ``gdn_decode_layer`` / ``attention_decode_layer``, the final
    norm and the LM head, bit for bit the calls ``forward_packed`` makes one by one. Bound once
    to the layers' fields (``layer_spec.LayerWeights``, each with its cache pools in the spec's
    order: conv and recurrent, or key and value pages, and a GDN layer's checkpoint pools)
    -- the caller binds again when a parameter or a pool is replaced; a step passes its own
    tensors. ``bind`` returns None where the layers' weights are not all in one format."""

    def __init__(self, native: Any, gdn_pools: list[tuple[torch.Tensor, torch.Tensor,
                                                           tuple[torch.Tensor | None,
                                                                 torch.Tensor | None]]],
                 matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 lm_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 quantized: bool, lm_quantized: bool, dtype: torch.dtype) -> None:
        self._native, self._gdn_pools = native, gdn_pools
        self._forms = (matmul, lm_matmul, quantized, lm_quantized, dtype)

    @classmethod
    def bind(cls, layers: list[tuple[LayerWeights,
                                     tuple[torch.Tensor, torch.Tensor],
                                     tuple[torch.Tensor | None, torch.Tensor | None]]],
             embed: torch.Tensor, final_norm: torch.Tensor, eps: float, lm_head: torch.Tensor,
             lm_quant: QuantizedWeight | None,
             matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
             lm_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
             ) -> DecodeStack | None:
        kinds: list[int] = []
        tensors: list[torch.Tensor] = []
        quant: list[torch.Tensor] = []
        ints: list[int] = []
        floats: list[float] = []
        gdn_pools = []
        if len({w.quant_bits for w, _, _ in layers}) != 1:
            return None
        for w, (a, b), checkpoints in layers:
            pools = dict(zip((f.name for f in w.spec.of(POOL)), (a, b), strict=True))
            layer_tensors, layer_ints, layer_floats = w.bound({**pools, "split": KV_SPLIT})
            kinds.append(w.spec.kind)
            tensors += layer_tensors
            ints += layer_ints
            floats += layer_floats
            quant += w.quant
            if w.spec is GDN:
                gdn_pools.append((a, b, checkpoints))
        bits = layers[0][0].quant_bits
        lm, lm_tensors, lm_bits = _held(lm_head, lm_quant)
        native = classes().DecodeStack(kinds, tensors, quant, ints, floats, bits, embed,
                                       final_norm, eps, lm, list(lm_tensors), lm_bits)
        return cls(native, gdn_pools, matmul, lm_matmul, bool(bits), lm_quant is not None,
                   embed.dtype)

    def why_not(self, meta: StepMetadata, num_logits: int) -> str | None:
        """Why a step does not run in this one call (None: it does): it is not decodes only, or
        its products (the layers' at the step's rows, the LM head's at ``num_logits`` rows)
        take a form the stack does not fuse (an int kernel past its rows, a dtype outside
        ``FUSED_DTYPES``)."""
        if not meta.all_decode:
            return "not a decode-only step"
        matmul, lm_matmul, quantized, lm_quantized, dtype = self._forms
        if _product_flag(meta.num_tokens, dtype, matmul, quantized) is None:
            return f"the layers' products at {meta.num_tokens} rows are not in a fused form"
        if _product_flag(num_logits, dtype, lm_matmul, lm_quantized) is None:
            return f"the LM head's product at {num_logits} rows is not in a fused form"
        return None

    def __call__(self, ids: torch.Tensor, meta: StepMetadata,
                 rope: tuple[torch.Tensor, torch.Tensor], logits_rows: torch.Tensor | None,
                 want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits of ``logits_rows`` (every row when None), the final-norm hidden
        ``[N, hidden]`` when ``want_hidden``) of a step ``why_not`` accepts, its pages and state
        rows advanced and its chunk-end checkpoints written. ``rope``: cos, sin tables
        ``[P, rotary_dim]`` past every position of the step."""
        matmul, lm_matmul, quantized, lm_quantized, dtype = self._forms
        n = ids.shape[0]
        native = _product_flag(n, dtype, matmul, quantized)
        lm_native = _product_flag(n if logits_rows is None else logits_rows.shape[0], dtype,
                                  lm_matmul, lm_quantized)
        assert meta.all_decode and native is not None and lm_native is not None, "why_not"
        assert meta.write_slots is not None
        out = self._native.run(ids, meta.positions, *rope, meta.state_slots, meta.fresh_t,
                               meta.write_slots, meta.block_table, meta.cu_seqlens_t, meta.past_t,
                               meta.seq_index(tuple(range(meta.batch))),
                               None if logits_rows is None else logits_rows.long(), native,
                               lm_native, want_hidden)
        if meta.checkpoints:
            for conv_pool, pool, checkpoints in self._gdn_pools:
                _save_chunk_ends(conv_pool, pool, checkpoints, meta)
        return out


def _gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                slots: torch.Tensor, fresh: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.float32)
    library().gated_delta_decode(q.float().contiguous(), k.float().contiguous(),  # type: ignore[attr-defined]
                             v.float().contiguous(), a.float().contiguous(),
                             b.float().contiguous(), a_log, dt_bias, pool, slots, fresh, out,
                             scale)
    return out


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None = None
                ) -> torch.Tensor:
    if meta.all_decode:
        o = _gdn_decode(q, k, v, a, b, a_log, dt_bias, pool, meta.state_slots, meta.fresh_t,
                        scale)
        torch_seam.save_chunk_ends(pool, checkpoints, meta)
        return o
    out = torch.empty(v.shape, dtype=torch.float32)
    if meta.decode:
        rows, sub = meta.subset(meta.decode)
        out.index_copy_(0, rows, _gdn_decode(
            q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, pool, sub.state_slots,
            sub.fresh_t, scale))
        torch_seam.save_chunk_ends(pool, checkpoints, sub)
    rows, sub = meta.subset(meta.multi)
    out.index_copy_(0, rows, torch_seam.gated_delta(
        q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, pool, sub, scale,
        checkpoints))
    return out


def _capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
             meta: StepMetadata, scale: float, capsule: Capsule) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.float32)
    library().gated_delta_capture(q.float().contiguous(), k.float().contiguous(),  # type: ignore[attr-defined]
                                  v.float().contiguous(), a.float().contiguous(),
                                  b.float().contiguous(), a_log, dt_bias, pool,
                                  meta.state_slots, meta.fresh_t, meta.cu_seqlens_t, out, scale,
                                  capsule.decay, capsule.key, capsule.delta)
    return out


def _replay(pool: torch.Tensor, slots: torch.Tensor, capsule: Capsule, begin: torch.Tensor,
            end: torch.Tensor) -> None:
    library().gated_delta_replay(pool, slots, capsule.decay, capsule.key, capsule.delta,  # type: ignore[attr-defined]
                                 begin, end)


def _replay_layers(conv_pools: list[torch.Tensor], pools: list[torch.Tensor],
                   capsules: list[Capsule], slots: torch.Tensor, begin: torch.Tensor,
                   end: torch.Tensor) -> None:
    library().commit_replay(conv_pools, [c.conv for c in capsules], pools,  # type: ignore[attr-defined]
                            [c.decay for c in capsules], [c.key for c in capsules],
                            [c.delta for c in capsules], slots, begin, end)


CAPTURE = StateCapture(_capture, _replay, _replay_layers)

FUSED = FusedDecode(gdn_decode, gdn_decode_layer, attention_decode_layer, layers_why_not,
                    DecodeStack.bind)
MTP = MtpKernels(mtp_head_input, mtp_head_output, mtp_chain, mtp_draft)
