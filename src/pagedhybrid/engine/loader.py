"""An ``Engine`` from a checkpoint folder: the dtype resolved, the tensor-parallel ranks started,
the model and its tokenizer loaded (``load_engine``; ``LLM`` and ``pagedhybrid serve`` build theirs
with it)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedhybrid import dtypes
from pagedhybrid.engine.core.config import EngineConfig
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.spec_decode.proposer import proposer_spec
from pagedhybrid.engine.worker.runner import load_model
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a model may be loaded in
# their accepted names (--dtype choices): "auto" (the checkpoint's dtype), logical ("float32")
# and short ("fp32") spellings
DTYPE_SPELLINGS = ("auto", *dtypes.spellings(MODEL_DTYPES, kinds=("logical", "cli")))


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"`` is the dtype the checkpoint records
    (``config.json`` ``dtype``/``torch_dtype``: a bf16 checkpoint stays bf16, as vLLM and
    transformers load it), float32 when it records none the engine serves."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_SPELLINGS:
        raise ContractViolation("LLM", "dtype", f"must be one of {list(DTYPE_SPELLINGS)}", dtype)
    if dtype == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPE_SPELLINGS else "float32"
    return dtypes.to_torch(dtype)



def load_engine(model: str | Path | None = None, *, dtype: str | torch.dtype = "auto",
                **config: object) -> Engine:
    """An ``Engine`` over a checkpoint folder (None = the built-in default model)."""
    from pagedhybrid.models.qwen35 import Qwen35Config, default_model_dir, load_tokenizer

    model_dir = default_model_dir() if model is None else Path(model)
    cfg = EngineConfig(**config)  # type: ignore[arg-type]
    checkpoint = Qwen35Config.from_model_dir(model_dir)
    mtp = cfg.speculative is not None and proposer_spec(cfg.speculative).model_head
    if mtp and checkpoint.mtp_num_hidden_layers != 1:
        raise ContractViolation("speculative_config", "method",
                                f"{cfg.speculative.method!r} needs a checkpoint with an MTP head "
                                f"(mtp_num_hidden_layers=1 and mtp.* tensors); {model_dir} has "
                                f"mtp_num_hidden_layers={checkpoint.mtp_num_hidden_layers}",
                                cfg.speculative.method)
    torch_dtype = resolve_dtype(dtype, checkpoint.checkpoint_dtype)
    peers = None
    if cfg.tensor_parallel_size > 1:  # the other ranks start and load while this one loads
        from pagedhybrid.engine.worker.distributed import start_ranks

        peers = start_ranks(cfg, model_dir, torch_dtype)
    try:
        net = load_model(model_dir, torch_dtype, cfg, None if peers is None else peers.parallel)
        try:
            tokenizer = load_tokenizer(model_dir, net.config.vocab_size)
        except UnsupportedConfiguration:
            tokenizer = None  # token-id prompts still work
        return Engine(net, cfg, tokenizer, peers)
    except BaseException:
        if peers is not None:
            peers.close(0.0)
        raise
