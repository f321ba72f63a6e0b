"""Dense forward of the Qwen3.5 model against HF transformers 5.24 (fp32, every weight random)."""

from __future__ import annotations

import pytest
import torch
from qwen35_tiny import HFSequence, build_hf_model, hf_logits, save_checkpoint, tiny_hf_config

from pagedhybrid.errors import ContractViolation
from pagedhybrid.models.qwen35 import load

TOL = 1e-4


def test_prompt_logits_match_hf(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(0))
    ours, past = model.forward_dense(ids)
    ref = hf_logits(tiny_checkpoint.hf, ids)
    err = (ours - ref).abs().max().item()
    assert err <= TOL, err
    assert past.seq_len == 11
    assert ours.dtype == torch.float32 and ours.shape == (3, 11, 96)


def test_continuation_with_cache_matches_hf(tiny_checkpoint):
    """Prefill, multi-token continuation, then single-token decode, each step against HF."""
    model = load(tiny_checkpoint.path)
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, 96, (1, n), generator=gen) for n in (6, 3, 1, 1, 2)]
    oracle = HFSequence(tiny_checkpoint.hf)
    past = None
    for chunk in chunks:
        ours, past = model.forward_dense(chunk, past)
        ref = oracle.step(chunk[0].tolist())
        err = (ours[0] - ref).abs().max().item()
        assert err <= TOL, (chunk.shape, err)
    # the states left behind match HF's cache, in our layouts
    cfg = model.config
    for i in cfg.full_attention_layers:
        assert (past.keys[i][0] - oracle.keys(i)).abs().max() <= TOL
        assert (past.values[i][0] - oracle.values(i)).abs().max() <= TOL
    for i in cfg.linear_attention_layers:
        assert (past.conv[i][0] - oracle.conv_state(i)).abs().max() <= TOL
        assert (past.recurrent[i][0] - oracle.recurrent_state(i)).abs().max() <= TOL
    # and the whole stream equals one no-cache run
    full = hf_logits(tiny_checkpoint.hf, torch.cat(chunks, dim=1))
    assert (model.forward_dense(torch.cat(chunks, dim=1))[0] - full).abs().max() <= TOL


@pytest.mark.parametrize("interval,layers", [(2, 4), (4, 4)])
def test_other_layer_patterns_match_hf(tmp_path, interval, layers):
    hf = build_hf_model(tiny_hf_config(full_attention_interval=interval,
                                       num_hidden_layers=layers, tie_word_embeddings=True,
                                       linear_value_head_dim=16), seed=interval)
    model = load(save_checkpoint(hf, tmp_path))
    assert model.config.layer_types == tuple(hf.config.layer_types)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(interval))
    ours, theirs = model.forward_dense(ids)[0].double(), hf_logits(hf, ids).double()
    truth = hf_logits(hf.double(), ids).double()  # (HF's own fp32 noise is the budget)
    budget = (theirs - truth).abs().max().item()
    err = (ours - truth).abs().max().item()
    assert err <= max(3 * budget, TOL), (err, budget)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.25), (torch.float16, 0.04)])
def test_half_precision_tracks_fp32(tiny_checkpoint, dtype, tol):
    """HF's own bf16/fp16 runs of this model deviate from fp32 by 0.18 / 0.018."""
    model = load(tiny_checkpoint.path, dtype=dtype)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(tiny_checkpoint.hf, ids)
    ours, past = model.forward_dense(ids)
    err = (ours - ref).abs().max().item()
    assert err <= tol, err
    assert past.recurrent[0].dtype == torch.float32 and past.conv[0].dtype == dtype


def test_bad_dense_inputs_are_typed(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    with pytest.raises(ContractViolation, match="input_ids"):
        model.forward_dense(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ContractViolation, match="token ids"):
        model.forward_dense(torch.full((1, 3), 96, dtype=torch.int64))
    _, past = model.forward_dense(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ContractViolation, match="past"):
        model.forward_dense(torch.zeros(1, 1, dtype=torch.int64), past)
