"""``genai_config.json`` for the packed paged hybrid graph, as onnxruntime-genai 0.18.0 reads it.

Layout (format A of ``reference/qwen35-model.md`` §6, the one 0.18.0's own builder writes):

* ``model.decoder.inputs`` / ``outputs`` map the packed inputs by identity and the per-layer state
  templates: ``past_key_names = past_key_values.%d.key`` (value alike), ``past_conv_names =
  past_key_values.%d.conv_state``, ``past_recurrent_names = past_key_values.%d.recurrent_state``
  and the ``present.%d.*`` outputs;
* ``model.decoder.state_groups``: ``paged_kv`` (full-attention layer ids), ``fixed_conv`` and
  ``fixed_recurrent`` (linear layer ids), from ``PackedAbi``;
* with ``--state-update-capacity C``: ``model.decoder.state_update_capacity = C``, the inputs
  ``state_update_capture_count`` / ``state_update_active``, the outputs
  ``state_update_conv_value_names = state_update.%d.conv_value`` and
  ``state_update_recurrent_capsule_names = state_update.%d.recurrent_capsule``, and each fixed
  state group's ``state_update`` (``capacity``; ``key_head_count`` for the recurrent group) --
  the bindings 0.18.0 reads to verify drafts and replay the accepted updates;
* with ``--mtp``: ``model.decoder.outputs.hidden_states``, the ``model.mtp`` section of the
  head graph (``export/mtp.py``) and ``speculative.max_draft_tokens = C - 1`` (a verify step is
  the last token and the drafts, within the capture capacity ``C``);
* ``model.decoder.session_options.provider_options``: ``cuda`` (``enable_cuda_graph=0``) or
  ``webgpu`` (graph capture off, basic validation);
* ``engine.dynamic_batching``: ``block_size``, ``max_batch_size``, ``num_blocks`` or
  ``gpu_utilization_factor`` (``--num-blocks``, the factor on CUDA, else the default page count
  of ``export/pages.py``), ``max_scheduled_tokens`` when given;
* ``search.max_length``: ``--max-length``, else the model's context;
  ``search.past_present_share_buffer = true`` (the caches are updated in place); with
  ``prefill_chunk_size`` also ``search.chunk_size`` (the most prompt tokens of one request per
  step).
"""

from __future__ import annotations

from typing import Any

from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import PackedAbi
from pagedhybrid.export.mtp import genai_mtp_section

PROVIDER_OPTIONS: dict[str, dict[str, str]] = {
    "cuda": {"enable_cuda_graph": "0"},
    "webgpu": {"enableGraphCapture": "0", "validationMode": "basic"},
}


def decoder_io(abi: PackedAbi) -> tuple[dict[str, str], dict[str, str]]:
    inputs = {name: name for name in c.SHARED_INPUTS}
    inputs |= {"past_key_names": c.PAST_KEY, "past_value_names": c.PAST_VALUE}
    outputs = {"logits": c.LOGITS, "present_key_names": c.PRESENT_KEY,
               "present_value_names": c.PRESENT_VALUE}
    if abi.linear_layers:
        inputs |= {"past_conv_names": c.PAST_CONV, "past_recurrent_names": c.PAST_RECURRENT}
        outputs |= {"present_conv_names": c.PRESENT_CONV,
                    "present_recurrent_names": c.PRESENT_RECURRENT}
    if abi.hidden_outputs():
        outputs["hidden_states"] = c.HIDDEN_STATES
    if abi.state_update_outputs():
        inputs |= {"state_update_capture_count": c.STATE_UPDATE_CAPTURE_COUNT,
                   "state_update_active": c.STATE_UPDATE_ACTIVE}
        outputs |= {"state_update_conv_value_names": c.STATE_UPDATE_CONV,
                    "state_update_recurrent_capsule_names": c.STATE_UPDATE_RECURRENT}
    return inputs, outputs


def _token(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def make_genai_config(abi: PackedAbi) -> dict[str, Any]:
    cfg, o = abi.config, abi.options
    inputs, outputs = decoder_io(abi)
    eos = _token(cfg.eos_token_id)
    pad = cfg.eos_token_id[0] if cfg.eos_token_id else 0
    dynamic: dict[str, Any] = {"block_size": o.block_size, "max_batch_size": o.max_batch_size}
    pages = o.page_plan(cfg)
    dynamic |= pages.budget()
    if o.max_scheduled_tokens is not None:
        dynamic["max_scheduled_tokens"] = o.max_scheduled_tokens
    model: dict[str, Any] = {
        "bos_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else pad,
        "context_length": cfg.max_position_embeddings,
        "decoder": {
            "session_options": {
                "log_id": "onnxruntime-genai",
                "provider_options": [{o.ep: dict(PROVIDER_OPTIONS[o.ep])}],
            },
            "filename": c.MODEL_FILE,
            "head_size": cfg.head_dim,
            "hidden_size": cfg.hidden_size,
            "inputs": inputs,
            "outputs": outputs,
            "num_attention_heads": cfg.num_attention_heads,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_key_value_heads": cfg.num_key_value_heads,
            "state_groups": abi.state_groups(),
            **({"state_update_capacity": abi.capacity} if abi.state_update_outputs() else {}),
        },
        "eos_token_id": eos if eos is not None else pad,
        "pad_token_id": pad,
        "type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size,
    }
    extra: dict[str, Any] = {}
    if o.mtp:
        model["mtp"] = genai_mtp_section(cfg.num_key_value_heads, cfg.head_dim)
        extra["speculative"] = {"max_draft_tokens": max(abi.capacity - 1, 1)}
    search: dict[str, Any] = {
        "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
        "length_penalty": 1.0, "max_length": pages.max_length, "min_length": 0,
        "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
        "past_present_share_buffer": True, "repetition_penalty": 1.0, "temperature": 1.0,
        "top_k": 50, "top_p": 1.0,
    }
    if o.prefill_chunk_size is not None:
        search["chunk_size"] = o.prefill_chunk_size
    return {"model": model, "search": search, "engine": {"dynamic_batching": dynamic}, **extra}
