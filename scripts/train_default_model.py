"""Train pagedhybrid's built-in default model: a small Qwen3.5 hybrid decoder on the KJV Bible.

    apt-get install bible-kjv          # Debian's KJV text (public domain) and its reader
    .venv/bin/python scripts/train_default_model.py [--minutes M] [--out DIR]

Data: the KJV text of Debian's ``bible-kjv-text`` package, dumped with its reader
(``bible gen1:1-rev22:21``) or read from ``--text FILE`` (the same dump). The copyright of the
1611 translation has expired (Debian's copyright file says so); the package's data file carries
Chip Chapin's "unrestricted use" notice. Every ``HELDOUT_EVERY``-th chapter is held out (written
as ``heldout.txt``, the perplexity text); the rest is training text: one document per chapter
(``Book N`` then one verse per line), plus short chat exchanges in the model's chat template
("Recite Genesis 1:1-3." -> the verses) so a chat server gets answers that end with
``<|im_end|>``.

Tokenizer: byte-level BPE trained with HF ``tokenizers`` on the training text (``VOCAB`` tokens,
specials ``<|endoftext|>`` (EOS), ``<|bos|>`` (BOS, prepended by the post-processor),
``<|im_start|>``, ``<|im_end|>``), saved as ``tokenizer.json`` + ``tokenizer_config.json``
(with the chat template) so HF ``PreTrainedTokenizerFast`` loads it.

Model: ``CONFIG`` (``qwen3_5_text``, both layer kinds, GQA, partial interleaved MRoPE, tied
embeddings). The parameters are the package's own ``Qwen35ForCausalLM`` modules (so the
state-dict names are HF's); the training forward below is a differentiable twin of the
inference math: causal SDPA for full attention, and for Gated DeltaNet the chunked WY form of the
gated delta rule (chunk 64) under autograd. Before training, the twin's logits are checked against
``forward_dense`` on the same weights.

Training: AdamW, linear warm-up then cosine decay, random windows of ``SEQ_LEN + 1`` tokens from
the packed token stream, fp32 throughout (bf16 autocast measured no faster here: the step is
bound by elementwise work), a fixed seed and 2 threads (deterministic on one machine), for
``--steps`` steps. The checkpoint (bf16 safetensors, config.json, generation_config.json,
tokenizer files, heldout.txt, training.json with the run's figures) is written to ``--out``
(default: the package's built-in folder); the model card README.md beside it quotes them and the
perplexities measured by ``benchmarks/perplexity.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedhybrid.models.qwen35 import Qwen35Config, Qwen35ForCausalLM, build
from pagedhybrid.models.qwen35.default_model import DEFAULT_MODEL_DIR
from pagedhybrid.models.qwen35.linear_attention import QK_L2_NORM_EPS
from pagedhybrid.models.qwen35.rope import mrope_cos_sin

SEED = 1611
BASE_STEPS, BASE_LR = 2400, 3e-3
VOCAB = 4096
SEQ_LEN = 256
HELDOUT_EVERY = 40
CHAT_FRACTION = 0.15  # chat exchanges per training chapter
SPECIALS = ("<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>")
EOS, BOS, IM_START, IM_END = range(4)
# ChatML turns, BOS first (every training document began with it); tools, tool calls and tool
# results in the Qwen3.5 format (serve/chat/format.py), without reasoning (the model was not
# trained to)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if system -%}{{ messages[0].content + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n"
    "<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and tools -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + (message.content or '') "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{{ ('\\n\\n' if (message.content or not loop.first) else '') + '<tool_call>\\n<function=' "
    "+ call.name + '>\\n' }}"
    "{%- for name, value in (call.arguments if call.arguments is mapping else {}).items() -%}"
    "{{ '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) "
    "+ '\\n</parameter>\\n' }}"
    "{%- endfor -%}{{ '</function>\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def model_config() -> Qwen35Config:
    layers = 8
    return Qwen35Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(layers)),
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, rope_theta=10000.0,
        partial_rotary_factor=0.25, mrope_section=(3, 3, 2), mrope_interleaved=True,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=2048,
        bos_token_id=BOS, eos_token_id=(EOS, IM_END), checkpoint_dtype="bfloat16")


# -- data ----------------------------------------------------------------------------------------
Chapter = tuple[str, int, list[str]]  # book, chapter number, verses


def read_kjv(text_file: str | None) -> str:
    if text_file:
        return Path(text_file).read_text(encoding="utf-8")
    if shutil.which("bible") is None:
        sys.exit("needs Debian's KJV: apt-get install bible-kjv (or pass --text FILE)")
    return subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True,
                          check=True).stdout


def parse_chapters(raw: str) -> list[Chapter]:
    """``Book N`` header lines, then verses ``  v text`` wrapped over several lines."""
    chapters: list[Chapter] = []
    header = re.compile(r"^([1-3]? ?[A-Z][A-Za-z ]+?) (\d+)$")
    for line in raw.splitlines():
        m = header.match(line)
        if m:
            chapters.append((m.group(1), int(m.group(2)), []))
            continue
        verse = re.match(r"^\s+(\d+) (.*)$", line)
        if verse:
            chapters[-1][2].append(verse.group(2).strip())
        elif line.strip() and chapters and chapters[-1][2]:
            chapters[-1][2][-1] += " " + line.strip()
    return chapters


def chapter_text(ch: Chapter) -> str:
    book, n, verses = ch
    return f"{book} {n}\n" + "\n".join(verses) + "\n"


def chat_text(ch: Chapter, rng: random.Random) -> str:
    book, n, verses = ch
    first = rng.randrange(len(verses))
    count = min(len(verses) - first, rng.randint(1, 3))
    span = f"{first + 1}" if count == 1 else f"{first + 1}-{first + count}"
    asks = [f"Recite {book} {n}:{span}.", f"What does {book} {n}:{span} say?",
            f"Continue: {verses[first].split(',')[0]}"]
    ask = rng.choice(asks)
    answer = " ".join(verses[first:first + count])
    return (f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")


def train_tokenizer(texts: list[str]):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS)])
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(4))
    return tok


# -- the differentiable twin of the inference forward --------------------------------------------
def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, c: int = 64) -> torch.Tensor:
    """Gated delta rule from a zero state, chunked WY form (autograd-friendly).

    q, k ``[B, H, T, Dk]`` (normalised, q scaled), v ``[B, H, T, Dv]``, g, beta ``[B, H, T]``;
    returns ``[B, H, T, Dv]``. State ``S [Dk, Dv]``; per chunk with cumulative log-decay ``G``:
    ``(I + L) [U | W] = [beta v | beta exp(G) k]`` with ``L_ij = beta_i (k_i.k_j) e^{G_i-G_j}``
    (j < i), ``V' = U - W S``, ``O = (e^G q) S + tril((q.k) e^{G_i-G_j}) V'``,
    ``S <- e^{G_C} S + (e^{G_C-G} k)^T V'``.
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    gc = g.cumsum(-1)  # [B, H, N, C]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    dec = (gc[..., :, None] - gc[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    lower = (k @ k.transpose(-1, -2)) * dec * beta[..., :, None]
    lower = lower.masked_fill(~incl.tril(-1), 0.0)  # strictly lower
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    tinv = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower).contiguous(),
                                         upper=False, unitriangular=True)
    u = tinv @ (beta[..., None] * v)  # [B, H, N, C, Dv]
    w = tinv @ (beta[..., None] * gc.exp()[..., None] * k)  # [B, H, N, C, Dk]
    qk = (q @ k.transpose(-1, -2)) * dec  # [B, H, N, C, C]
    qg = q * gc.exp()[..., None]
    kd = k * (gc[..., -1:] - gc).exp()[..., None]
    s = q.new_zeros(b, h, dk, dv)
    outs = []
    for j in range(n):
        vnew = u[:, :, j] - w[:, :, j] @ s  # [B, H, C, Dv]
        outs.append(qg[:, :, j] @ s + qk[:, :, j] @ vnew)
        s = s * gc[:, :, j, -1:, None].exp() + kd[:, :, j].transpose(-1, -2) @ vnew
    return torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + QK_L2_NORM_EPS)


def gdn_layer(attn, x: torch.Tensor) -> torch.Tensor:  # attn: models.qwen35 GatedDeltaNet
    bsz, t, _ = x.shape
    qkv = attn.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
    qkv = F.silu(F.conv1d(qkv, attn.conv1d.weight, padding=attn.kernel - 1,
                          groups=attn.conv_dim)[..., :t]).transpose(1, 2)  # [B, T, C]
    q, k, v = torch.split(qkv, [attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    hk, hv, dk, dv = attn.num_k_heads, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim
    q = l2_normalize(q.reshape(bsz, t, hk, dk)).repeat_interleave(hv // hk, dim=2) * dk ** -0.5
    k = l2_normalize(k.reshape(bsz, t, hk, dk)).repeat_interleave(hv // hk, dim=2)
    v = v.reshape(bsz, t, hv, dv).float()
    beta = torch.sigmoid(attn.in_proj_b(x).float())  # [B, T, Hv]
    g = -attn.A_log.exp() * F.softplus(attn.in_proj_a(x).float() + attn.dt_bias)
    core = chunk_gated_delta(*(y.transpose(1, 2) for y in (q, k, v, g, beta)))  # [B, Hv, T, Dv]
    z = attn.in_proj_z(x).view(bsz, t, hv, dv)
    y = attn.norm(core.transpose(1, 2).to(x.dtype), z).reshape(bsz, t, hv * dv)
    return attn.out_proj(y)


def attention_layer(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    bsz, t, _ = x.shape
    q, k, v, gate = attn.project(x.reshape(bsz * t, -1), cos, sin)
    q, k, v = (y.view(bsz, t, -1, attn.head_dim).transpose(1, 2) for y in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return attn.output(o.transpose(1, 2).reshape(bsz * t, -1), gate).view(bsz, t, -1)


def rope(model: Qwen35ForCausalLM, bsz: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of positions ``0 .. t-1`` in each of ``bsz`` rows."""
    return mrope_cos_sin(model.config, torch.arange(t).repeat(bsz).view(1, -1).expand(3, -1))


def train_hidden(model: Qwen35ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, T]`` -> the final-norm hidden ``[B, T, hidden]`` (positions from 0)."""
    cos, sin = rope(model, *ids.shape)
    h = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = layer.input_layernorm(h)
        if layer.is_full:
            h = h + attention_layer(layer.self_attn, x, cos, sin)
        else:
            h = h + gdn_layer(layer.linear_attn, x)
        h = layer.feed_forward(h)
    return model.model.norm(h)


def train_forward(model: Qwen35ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, T]`` -> fp32 logits ``[B, T, V]`` (positions from 0)."""
    return model.lm_head(train_hidden(model, ids)).float()


def mtp_forward(model: Qwen35ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor
                ) -> torch.Tensor:
    """The MTP head (``MtpHead``) over whole rows: ``hidden [B, T, H]`` (final-norm hidden at
    positions ``0 .. T-1``), ``next_ids [B, T]`` (the token after each) -> the head's hidden
    ``[B, T, H]``, whose LM-head logits predict the token after ``next_ids``."""
    head = model.mtp
    assert head is not None
    bsz, t, _ = hidden.shape
    cos, sin = rope(model, bsz, t)
    x = torch.cat([head.pre_fc_norm_embedding(model.model.embed_tokens(next_ids)),
                   head.pre_fc_norm_hidden(hidden)], dim=-1)
    h = head.fc(x)
    layer = head.layer
    h = layer.feed_forward(h + attention_layer(layer.self_attn, layer.input_layernorm(h), cos,
                                               sin))
    return head.norm(h)


def init_weights(model: Qwen35ForCausalLM, gen: torch.Generator) -> None:
    """HF's init: N(0, 0.02) projections/embeddings, zero offset norms, unit gated norms,
    ``A = U(1, 16)`` (``A_log = log A``), ``dt_bias`` from ``dt ~ logU(1e-3, 0.1)``."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3))
                               + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.weight"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for p in model.parameters():
            p.requires_grad_(True)


# -- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="KJV text dump (default: run Debian's `bible`)")
    ap.add_argument("--out", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--steps", type=int, default=None,
                    help=f"default {BASE_STEPS} (the base), {MTP_STEPS} (--mtp)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None,
                    help=f"default {BASE_LR} (the base), {MTP_LR} (--mtp)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--mtp", action="store_true",
                    help="train only the MTP head, on the model in --out (frozen), and add it "
                    "to that checkpoint (defaults: --steps 400 --lr 2e-3, then --kd-steps)")
    ap.add_argument("--kd-steps", type=int, default=MTP_KD_STEPS,
                    help="MTP: steps of self-distillation from the base after --steps")
    ap.add_argument("--resume", action="store_true",
                    help="MTP: start from the head in --out and run the distillation only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    t_start = time.perf_counter()

    chapters = parse_chapters(read_kjv(args.text))
    assert len(chapters) == 1189, len(chapters)
    heldout = [ch for i, ch in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [ch for i, ch in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    docs = [chapter_text(ch) for ch in train]
    chats = [chat_text(rng.choice(train), rng) for _ in range(int(CHAT_FRACTION * len(train) * 8))]
    if args.mtp:  # the base's own tokenizer and the same token stream (same seed)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.out) / "tokenizer.json"))
    else:
        tok = train_tokenizer(docs + chats)
    stream: list[int] = []
    pieces = [(d, True) for d in docs] + [(c, False) for c in chats]
    rng.shuffle(pieces)
    for text, plain in pieces:
        ids = tok.encode(text).ids  # BOS + text
        stream += [*ids, EOS] if plain else ids
    data = torch.tensor(stream, dtype=torch.int64)
    print(f"{len(train)} training chapters, {len(chats)} chat exchanges, {len(heldout)} held "
          f"out; {len(data)} training tokens", flush=True)
    if args.mtp:
        return train_mtp(args, data, Path(args.out))
    steps0 = BASE_STEPS if args.steps is None else args.steps
    lr_peak = BASE_LR if args.lr is None else args.lr

    config = model_config()
    model = build(config, torch.float32, "cpu")
    init_weights(model, torch.Generator().manual_seed(SEED))
    model.train()
    with torch.no_grad():  # the twin equals the inference forward on these weights
        probe = data[:2 * 100].view(2, 100)
        twin = train_forward(model, probe)
        ref, _ = model.forward_dense(probe)
        gap = (twin - ref).abs().max().item()
    assert gap < 1e-4, f"training forward differs from forward_dense by {gap}"
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters; twin vs forward_dense {gap:.1e}", flush=True)

    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # norms, A_log, dt_bias
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": vectors, "weight_decay": 0.0}], lr=lr_peak,
                            betas=(0.9, 0.95))
    steps = args.probe or steps0
    gen = torch.Generator().manual_seed(SEED)
    log = []
    t_train = time.perf_counter()
    for step in range(steps):
        lr = lr_peak * min(1.0, (step + 1) / args.warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s:s + SEQ_LEN + 1] for s in starts.tolist()])
        logits = train_forward(model, window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            el = time.perf_counter() - t_train
            print(f"step {step:5d} loss {sum(log[-50:]) / len(log[-50:]):.3f} lr {lr:.2e} "
                  f"{(step + 1) * args.batch * SEQ_LEN / el:.0f} tok/s {el / 60:.1f} min",
                  flush=True)
    train_s = time.perf_counter() - t_train
    if args.probe:
        return 0
    save(Path(args.out), model, tok, heldout, {
        "params": params, "train_tokens": len(data), "steps": steps, "batch": args.batch,
        "seq_len": SEQ_LEN, "train_minutes": train_s / 60,
        "total_minutes": (time.perf_counter() - t_start) / 60, "final_loss": sum(log[-100:]) /
        len(log[-100:]), "chapters": (len(train), len(heldout)), "chats": len(chats)})
    return 0


MTP_STEPS, MTP_LR = 400, 2e-3  # phase 1: the data's own tokens
MTP_KD_STEPS, MTP_KD_LR = 200, 1e-3  # phase 2: the base's distributions (self-distillation)


def train_mtp(args: argparse.Namespace, data: torch.Tensor, out: Path) -> int:
    """The MTP head of the model in ``out``, trained with the base frozen. Row ``p`` reads the
    base's final-norm hidden ``h_p`` and token ``t_{p+1}`` and predicts ``t_{p+2}`` (loss 1);
    the head's own hidden then stands in for ``h`` one token further on, predicting ``t_{p+3}``
    (loss 2, weight 1/2: what the second step of a draft chain sees). Phase 1 (``--steps``,
    default 400) learns the data's tokens; phase 2 (``--kd-steps``, default 200) learns the
    frozen base's own distributions at those positions (cross-entropy against its softmax):
    drafts are judged by the base's choices, not the text's. The head's layer starts as a copy
    of the base's last full-attention layer, ``fc`` at N(0, 0.02), its norms at zero (unit
    scale); ``--resume`` starts from the head already in ``out`` and runs phase 2 only. Writes
    ``mtp.*`` (bf16) into ``model.safetensors``, ``mtp_num_hidden_layers: 1`` into
    ``config.json`` and the run's figures into ``training.json`` (``mtp``)."""
    from safetensors.torch import load_file, save_file

    from pagedhybrid.models.qwen35 import load

    steps = MTP_STEPS if args.steps is None else args.steps
    lr0 = MTP_LR if args.lr is None else args.lr
    if args.resume:
        model = load(out, torch.float32, mtp=True)
    else:
        base = load(out, torch.float32)
        config = dataclasses.replace(base.config, mtp_num_hidden_layers=1)
        model = build(config, torch.float32, "cpu", mtp=True)
        state = {k: v.float() for k, v in base.state_dict().items()}
        last_full = config.full_attention_layers[-1]
        assert model.mtp is not None
        for name, t in model.mtp.state_dict().items():
            if name.startswith("layers.0."):
                src = name.replace("layers.0.", f"model.layers.{last_full}.", 1)
                state["mtp." + name] = state[src].clone()
            elif name.startswith("fc."):
                state["mtp." + name] = torch.randn(
                    t.shape, generator=torch.Generator().manual_seed(SEED)) * 0.02
            else:
                state["mtp." + name] = torch.zeros(t.shape)
        model.load_weights(state)
    head = model.mtp
    assert head is not None
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    t0 = time.perf_counter()
    figures: dict[str, object] = {"params": sum(p.numel() for p in params), "batch": args.batch,
                                  "seq_len": SEQ_LEN}
    phases = [("kd", args.kd_steps, MTP_KD_LR)]
    if not args.resume:
        phases.insert(0, ("tokens", steps, lr0))
    for name, n, lr in phases:
        loss = _mtp_phase(model, data, n, lr, args.batch, kd=name == "kd")
        figures[name] = {"steps": n, "lr": lr, "final_loss_next2": loss[0],
                         "final_loss_next3": loss[1]}
    weights = load_file(str(out / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    weights.update({"mtp." + k: v.detach().to(torch.bfloat16).contiguous()
                    for k, v in head.state_dict().items()})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stats = json.loads((out / "training.json").read_text())
    prev = stats.get("mtp", {}) if args.resume else {}
    figures["train_minutes"] = prev.get("train_minutes", 0.0) + (time.perf_counter() - t0) / 60
    stats["mtp"] = {**prev, **figures}
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"wrote the MTP head into {out}: {json.dumps(stats['mtp'])}")
    return 0


def _mtp_phase(model: Qwen35ForCausalLM, data: torch.Tensor, steps: int, lr0: float,
               batch: int, kd: bool) -> tuple[float, float]:
    """One training phase of the head (``train_mtp``); the last 50 steps' mean losses."""
    head = model.mtp
    assert head is not None
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr0, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED + (2 if kd else 1))
    log: list[tuple[float, float]] = []
    t0, t = time.perf_counter(), SEQ_LEN
    for step in range(steps):
        lr = lr0 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - t - 3, (batch,), generator=gen)
        w = torch.stack([data[s:s + t + 3] for s in starts.tolist()])
        with torch.no_grad():
            hid = train_hidden(model, w[:, :t])  # h_0 .. h_{T-1}
            soft = model.lm_head(hid).float().softmax(-1) if kd else None  # row p: t_{p+1}
        one = mtp_forward(model, hid, w[:, 1:t + 1])  # row p predicts t_{p+2}
        two = mtp_forward(model, one[:, :-1], w[:, 2:t + 1])  # row p predicts t_{p+3}
        if soft is None:
            loss1 = F.cross_entropy(model.lm_head(one).float().reshape(-1, VOCAB),
                                    w[:, 2:t + 2].reshape(-1))
            loss2 = F.cross_entropy(model.lm_head(two).float().reshape(-1, VOCAB),
                                    w[:, 3:t + 2].reshape(-1))
        else:  # the base's own distribution of the same token, one / two rows on
            loss1 = -(soft[:, 1:] * model.lm_head(one[:, :-1]).float().log_softmax(-1)).sum(
                -1).mean()
            loss2 = -(soft[:, 2:] * model.lm_head(two[:, :-1]).float().log_softmax(-1)).sum(
                -1).mean()
        opt.zero_grad(set_to_none=True)
        (loss1 + 0.5 * loss2).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log.append((loss1.item(), loss2.item()))
        if step % 25 == 0 or step == steps - 1:
            last = log[-25:]
            print(f"mtp {'kd' if kd else 'tokens'} step {step:4d} loss1 "
                  f"{sum(a for a, _ in last) / len(last):.3f} loss2 "
                  f"{sum(b for _, b in last) / len(last):.3f} lr {lr:.2e} "
                  f"{(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    tail = log[-50:]
    return sum(a for a, _ in tail) / len(tail), sum(b for _, b in tail) / len(tail)


def save(out: Path, model: Qwen35ForCausalLM, tok, heldout: list[Chapter],
         stats: dict[str, object]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().to(torch.float32 if k.endswith(("A_log", "dt_bias"))
                              else torch.bfloat16).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": BOS, "eos_token_id": [EOS, IM_END], "pad_token_id": EOS,
        "do_sample": False}, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": cfg.max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "heldout.txt").write_text("\n".join(chapter_text(ch) for ch in heldout),
                                     encoding="utf-8")
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"wrote {out}: {json.dumps(stats)}")


if __name__ == "__main__":
    sys.exit(main())
