"""``pagedhybrid calibrate-kv``: static K/V scales for quantized pages from a calibration text.

The model runs its dense forward over windows of the text (``--context`` tokens, disjoint);
each full-attention layer's keys (after q/k norm and RoPE, exactly what the pages hold) and
values are reduced per kv head and channel to their absolute maximum -- or, with
``--percentile P``, the P-th percentile of ``|x|`` over the calibration tokens, which clips rare
outliers. PER_CHANNEL scales are ``amax[h, c] / qmax``, PER_TENSOR ``max(amax) / qmax``
(``qmax`` = 127 for int8, 448 for float8e4m3fn), floored at ``1e-8``. The file
(``pagedhybrid.kvquant.save_scales``) goes to ``--out``, by default
``kv_scales/{dtype}-{quant}.safetensors`` in the checkpoint folder (``default_scales_path``; out
of the top folder, whose ``*.safetensors`` weight loaders read), where the engine and the
exporter find it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from pagedhybrid.errors import ContractViolation, PagedHybridError
from pagedhybrid.kvquant import (
    QMAX,
    QUANTS,
    KVScales,
    default_scales_path,
    dtype_name,
    kv_dtype,
    save_scales,
)

OP = "pagedhybrid calibrate-kv"


@torch.no_grad()
def channel_amax(model: Any, ids: list[int], context: int, percentile: float | None = None
                 ) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], int]:
    """Per full layer: (K, V) statistic ``[Hkv, D]`` float32 over the windows; tokens used."""
    if len(ids) < 2:
        raise ContractViolation(OP, "--text", "must hold at least 2 tokens", len(ids))
    rows: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    used = 0
    for start in range(0, len(ids), context):
        window = torch.tensor(ids[start:start + context], dtype=torch.int64)[None]  # [1, S]
        _, cache = model.forward_dense(window)
        used += window.shape[1]
        for i, k in cache.keys.items():
            ks, vs = rows.setdefault(i, ([], []))
            ks.append(k[0].abs().float())  # [S, Hkv, D]
            vs.append(cache.values[i][0].abs().float())
    out = {}
    for i, (ks, vs) in rows.items():
        k, v = torch.cat(ks), torch.cat(vs)  # [T, Hkv, D]
        if percentile is None:
            out[i] = (k.amax(0), v.amax(0))
        else:
            q = percentile / 100.0
            out[i] = (torch.quantile(k, q, dim=0), torch.quantile(v, q, dim=0))
    return out, used


def scales_from_amax(amax: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                     quant: str) -> dict[int, KVScales]:
    qmax = QMAX[dtype]

    def one(a: torch.Tensor) -> torch.Tensor:  # [Hkv, D] -> ORT layout
        if quant == "per-tensor":
            return (a.max() / qmax).clamp(min=1e-8).reshape(1)
        return (a / qmax).clamp(min=1e-8).unsqueeze(1).contiguous()  # [Hkv, 1, D]

    return {i: KVScales(one(k), one(v)) for i, (k, v) in amax.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: built-in model)")
    p.add_argument("--text", required=True, help="UTF-8 calibration text")
    p.add_argument("--out", default=None, help="scale file (default: kv_scales/{dtype}-{quant}"
                   ".safetensors in the checkpoint folder)")
    p.add_argument("--quant", choices=list(QUANTS), default="per-channel")
    p.add_argument("--dtype", choices=["int8", "fp8", "fp8_e4m3"], default="int8")
    p.add_argument("--percentile", type=float, default=None,
                   help="use this percentile of |x| instead of the maximum (e.g. 99.99)")
    p.add_argument("--context", type=int, default=512, help="tokens per forward window")
    p.add_argument("--max-tokens", type=int, default=None, help="calibrate on the first N")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pagedhybrid.models.qwen35 import default_model_dir, load, load_tokenizer

    try:
        if args.percentile is not None and not 0.0 < args.percentile <= 100.0:
            raise ContractViolation(OP, "--percentile", "must be in (0, 100]", args.percentile)
        if args.context < 1:
            raise ContractViolation(OP, "--context", "must be >= 1", args.context)
        model_dir = Path(args.model) if args.model else default_model_dir()
        text_path = Path(args.text)
        if not text_path.is_file():
            raise ContractViolation(OP, "--text", "must be a readable file", str(text_path))
        dtype = kv_dtype(args.dtype)
        model = load(model_dir)
        tok = load_tokenizer(model_dir, model.config.vocab_size)
        ids = tok.encode(text_path.read_text(encoding="utf-8"))[:args.max_tokens]
        amax, used = channel_amax(model, ids, args.context, args.percentile)
        if not amax:
            raise ContractViolation(OP, "--model", "has no full-attention layer", str(model_dir))
        scales = scales_from_amax(amax, dtype, args.quant)
        out = Path(args.out) if args.out else default_scales_path(model_dir, dtype, args.quant)
        save_scales(out, scales, dtype, args.quant, {
            "statistic": "absmax" if args.percentile is None else f"p{args.percentile}",
            "tokens": str(used), "text": text_path.name})
    except (PagedHybridError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {dtype_name(dtype)} {args.quant} scales of {len(scales)} layers from "
          f"{used} tokens")
    return 0
