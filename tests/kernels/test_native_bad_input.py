"""The native ops refuse bad input before touching memory, naming the op, argument and rule.

For every op the extension exports: a good call runs; each corruption (a page id past the pool
or negative where a sequence reads it, a state slot out of range or repeated, a wrong head
ratio, wrong dims / dtype / shape, a non-contiguous tensor, inconsistent lengths) raises
``ValueError`` "pagedhybrid.<op>: <argument>: <rule>"; the process survives, nothing was
written, and the good call after gives the same result as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedhybrid.kernels.native import KV_SPLIT, library, status

Args = dict[str, Any]
Corruption = tuple[str, Callable[[Args], None], str]  # (id, mutate, message regex)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert status().available, status().reason  # make test builds the extension first


def _set(key: str, value: Callable[[Args], Any]) -> Callable[[Args], None]:
    def mutate(a: Args) -> None:
        a[key] = value(a)

    return mutate


def _table(b: int, j: int, page: int) -> Callable[[Args], None]:
    def mutate(a: Args) -> None:
        t = a["block_table"].clone()
        t[b, j] = page
        a["block_table"] = t

    return mutate


# -- paged_attention ----------------------------------------------------------------------------

P, BS, HQ, HKV, D = 6, 16, 4, 2, 32


def _attention() -> Args:
    gen = torch.Generator().manual_seed(0)
    # sequence 0: 20 past + 1 new (2 pages); sequence 1: 3 past + 2 new (1 page, -1 padding)
    return {"q": torch.randn(3, HQ, D, generator=gen),
            "key_cache": torch.randn(P, BS, HKV, D, generator=gen),
            "value_cache": torch.randn(P, BS, HKV, D, generator=gen),
            "block_table": torch.tensor([[4, 1], [2, -1]], dtype=torch.int32),
            "cu_seqlens": torch.tensor([0, 1, 3], dtype=torch.int32),
            "past_lens": torch.tensor([20, 3], dtype=torch.int32),
            "seqs": torch.tensor([0, 1], dtype=torch.int32),
            "out": torch.zeros(3, HQ, D), "scale": D ** -0.5, "split": KV_SPLIT}


ATTENTION: list[Corruption] = [
    ("page past the pool", _table(0, 1, P), r"block_table: block_table\[0\]\[1\] = 6 is "
     r"outside the page pool \[0, 6\)"),
    ("page far past the pool", _table(1, 0, 1 << 30), r"block_table.*outside the page pool"),
    ("negative page read", _table(0, 0, -1), r"block_table: block_table\[0\]\[0\] = -1 is "
     r"outside the page pool"),
    ("table row too short", _set("past_lens", lambda a: torch.tensor([40, 3], dtype=torch.int32)),
     r"block_table: sequence 0 has 41 keys and needs 3 pages, its row holds 2"),
    ("negative past", _set("past_lens", lambda a: torch.tensor([20, -4], dtype=torch.int32)),
     r"past_lens: past_lens\[1\] = -4 is negative"),
    ("head ratio", _set("q", lambda a: torch.randn(3, 3, D)), r"q: head ratio: the query heads "
     r"\(3\) must be a multiple of the kv heads of key_cache \(2\)"),
    ("q dims", _set("q", lambda a: a["q"].reshape(3, HQ * D)), r"q: must have 3 dimensions"),
    ("q dtype", _set("q", lambda a: a["q"].bfloat16()), r"q: must be Float \(got BFloat16\)"),
    ("head size", _set("q", lambda a: torch.randn(3, HQ, 300)), r"q: head size must be in "
     r"\[1, 256\]"),
    ("head size of the cache", lambda a: a.update(key_cache=torch.randn(P, BS, HKV, 16),
                                                  value_cache=torch.randn(P, BS, HKV, 16)),
     r"key_cache: size\(3\) must equal the head size of q = 32"),
    ("value shape", _set("value_cache", lambda a: torch.randn(P + 1, BS, HKV, D)),
     r"value_cache: must have key_cache's shape"),
    ("value dtype", _set("value_cache", lambda a: a["value_cache"].half()),
     r"value_cache: must be Float \(got Half\)"),
    ("cache dtype", lambda a: a.update(key_cache=a["key_cache"].double(),
                                       value_cache=a["value_cache"].double()),
     r"key_cache: dtype must be float32, bfloat16, float16, int8 or float8_e4m3fn"),
    ("cache not contiguous", _set("key_cache", lambda a: a["key_cache"].transpose(1, 2)),
     r"key_cache: must be contiguous"),
    ("block size", lambda a: a.update(key_cache=torch.randn(P, 12, HKV, D),
                                      value_cache=torch.randn(P, 12, HKV, D)),
     r"key_cache: block size \(size\(1\)\) must be a power of two \(got 12\)"),
    ("split", _set("split", lambda a: 40), r"split: must be a positive multiple of the block "
     r"size 16"),
    ("table dtype", _set("block_table", lambda a: a["block_table"].long()),
     r"block_table: must be Int \(got Long\)"),
    ("table dims", _set("block_table", lambda a: a["block_table"].flatten()),
     r"block_table: must have 2 dimensions"),
    ("seq out of range", _set("seqs", lambda a: torch.tensor([0, 2], dtype=torch.int32)),
     r"seqs: seqs\[1\] = 2 is not a sequence of the batch \[0, 2\)"),
    ("negative seq", _set("seqs", lambda a: torch.tensor([-1], dtype=torch.int32)),
     r"seqs: seqs\[0\] = -1 is not a sequence"),
    ("repeated seq", _set("seqs", lambda a: torch.tensor([1, 1], dtype=torch.int32)),
     r"seqs: sequence 1 is listed twice"),
    ("cu end", _set("cu_seqlens", lambda a: torch.tensor([0, 1, 9], dtype=torch.int32)),
     r"cu_seqlens: cu_seqlens\[2\] must equal the number of token rows 3 \(got 9\)"),
    ("cu decreasing", _set("cu_seqlens", lambda a: torch.tensor([0, 4, 3], dtype=torch.int32)),
     r"cu_seqlens: must be non-decreasing"),
    ("cu start", _set("cu_seqlens", lambda a: torch.tensor([1, 2, 3], dtype=torch.int32)),
     r"cu_seqlens: must start at 0"),
    ("cu length", _set("cu_seqlens", lambda a: torch.tensor([0, 3], dtype=torch.int32)),
     r"cu_seqlens: size\(0\) must equal the number of sequences \+ 1 = 3"),
    ("past length", _set("past_lens", lambda a: torch.tensor([20], dtype=torch.int32)),
     r"past_lens: size\(0\) must equal the number of sequences"),
    ("out shape", _set("out", lambda a: torch.zeros(2, HQ, D)), r"out: must have q's shape"),
    ("out dtype", _set("out", lambda a: torch.zeros(3, HQ, D, dtype=torch.float64)),
     r"out: must be Float \(got Double\)"),
]


def _run_attention(a: Args) -> None:
    library().paged_attention(a["q"], a["key_cache"], a["value_cache"], a["block_table"],
                              a["cu_seqlens"], a["past_lens"], a["seqs"], a["out"], a["scale"],
                              a["split"])


# -- gated delta ---------------------------------------------------------------------------------

S, HK, HV, DK, DV = 4, 2, 4, 8, 8


def _gdn(varlen: bool) -> Args:
    gen = torch.Generator().manual_seed(1)
    t = 3 if varlen else 2  # varlen: sequence 0 has 2 tokens, sequence 1 has 1
    a = {"q": torch.randn(t, HK, DK, generator=gen), "k": torch.randn(t, HK, DK, generator=gen),
         "v": torch.randn(t, HV, DV, generator=gen), "a": torch.randn(t, HV, generator=gen),
         "b": torch.randn(t, HV, generator=gen), "a_log": torch.randn(HV, generator=gen),
         "dt_bias": torch.randn(HV, generator=gen), "pool": torch.randn(S, HV, DV, DK,
                                                                         generator=gen),
         "slots": torch.tensor([3, 1]), "fresh": torch.tensor([False, True]),
         "out": torch.zeros(t, HV, DV), "scale": DK ** -0.5}
    if varlen:
        a["cu_seqlens"] = torch.tensor([0, 2, 3], dtype=torch.int32)
    return a


def _slots(values: list[int]) -> Callable[[Args], None]:
    return _set("slots", lambda a: torch.tensor(values))


SLOT_CASES: list[Corruption] = [
    ("slot past the pool", _slots([3, 4]), r"slots: slots\[1\] = 4 is outside the state pool "
     r"\[0, 4\)"),
    ("negative slot", _slots([-1, 1]), r"slots: slots\[0\] = -1 is outside the state pool"),
    ("repeated slot", _slots([2, 2]), r"slots: slot 2 is repeated"),
    ("slot count", _slots([0]), r"slots: size\(0\) must equal the number of sequences = 2"),
    ("slot dtype", _set("slots", lambda a: a["slots"].int()), r"slots: must be Long \(got Int\)"),
    ("fresh dtype", _set("fresh", lambda a: a["fresh"].int()), r"fresh: must be Bool"),
    ("fresh count", _set("fresh", lambda a: torch.tensor([True])),
     r"fresh: size\(0\) must equal the number of sequences"),
]

GDN: list[Corruption] = [
    *SLOT_CASES,
    ("head ratio", lambda a: a.update(v=torch.randn(a["v"].shape[0], 3, DV),
                                      a=torch.randn(a["a"].shape[0], 3),
                                      b=torch.randn(a["b"].shape[0], 3),
                                      out=torch.zeros(a["v"].shape[0], 3, DV)),
     r"v: head ratio: the value heads \(3\) must be a multiple of the key heads of q and k "
     r"\(2\)"),
    ("q dims", _set("q", lambda a: a["q"].flatten(1)), r"q: must have 3 dimensions"),
    ("q dtype", _set("q", lambda a: a["q"].bfloat16()), r"q: must be Float \(got BFloat16\)"),
    ("k shape", _set("k", lambda a: a["k"][:, :1].contiguous()), r"k: must have q's shape"),
    ("v rows", _set("v", lambda a: a["v"][:1].contiguous()),
     r"v: size\(0\) must equal the token rows of q"),
    ("a shape", _set("a", lambda a: a["a"][:, :2].contiguous()),
     r"a: size\(1\) must equal the value heads of v"),
    ("a_log shape", _set("a_log", lambda a: torch.zeros(HV + 1)),
     r"a_log: size\(0\) must equal the value heads of v"),
    ("pool head size", _set("pool", lambda a: torch.zeros(S, HV, DV, DK + 1)),
     r"pool: size\(3\) must equal the key head size of q = 8"),
    ("pool not contiguous", _set("pool", lambda a: torch.zeros(S, HV, DK, DV).transpose(2, 3)),
     r"pool: must be contiguous"),
    ("out shape", _set("out", lambda a: torch.zeros(1, HV, DV)), r"out: must have v's shape"),
]
GDN_VARLEN: list[Corruption] = [
    *GDN,
    ("cu end", _set("cu_seqlens", lambda a: torch.tensor([0, 2, 5], dtype=torch.int32)),
     r"cu_seqlens: cu_seqlens\[2\] must equal the number of token rows 3 \(got 5\)"),
    ("cu decreasing", _set("cu_seqlens", lambda a: torch.tensor([0, 4, 3], dtype=torch.int32)),
     r"cu_seqlens: must be non-decreasing"),
    ("cu dtype", _set("cu_seqlens", lambda a: a["cu_seqlens"].long()),
     r"cu_seqlens: must be Int"),
]


CAP = 3  # capsule tokens


def _capture() -> Args:
    return {**_gdn(True), "fresh": torch.tensor([False, False]),
            "decay": torch.zeros(S, CAP, HV), "key": torch.zeros(S, CAP, HK, DK),
            "delta": torch.zeros(S, CAP, HV, DV)}


CAPSULE_CASES: list[Corruption] = [
    ("decay shape", _set("decay", lambda a: torch.zeros(S, CAP, HV + 1)),
     r"decay: must be \[slots, capacity, ...\] = \[4, 3, 4\]"),
    ("key head size", _set("key", lambda a: torch.zeros(S, CAP, HK, DK + 1)),
     r"key: must be \[slots, capacity, ...\]"),
    ("delta dtype", _set("delta", lambda a: a["delta"].double()), r"delta: must be Float"),
]
CAPTURE: list[Corruption] = [
    *GDN_VARLEN, *CAPSULE_CASES,
    ("chunk over the capacity", lambda a: a.update(
        decay=torch.zeros(S, 1, HV), key=torch.zeros(S, 1, HK, DK),
        delta=torch.zeros(S, 1, HV, DV)),
     r"cu_seqlens: sequence 0 has 2 tokens, more than the capsule's capacity 1"),
]


def _run_capture(a: Args) -> None:
    names = ["q", "k", "v", "a", "b", "a_log", "dt_bias", "pool", "slots", "fresh",
             "cu_seqlens", "out", "scale", "decay", "key", "delta"]
    library().gated_delta_capture(*[a[n] for n in names])


def _replay() -> Args:
    gen = torch.Generator().manual_seed(10)
    return {"pool": torch.randn(S, HV, DV, DK, generator=gen), "slots": torch.tensor([3, 1]),
            "decay": torch.rand(S, CAP, HV, generator=gen),
            "key": torch.randn(S, CAP, HK, DK, generator=gen),
            "delta": torch.randn(S, CAP, HV, DV, generator=gen),
            "begin": torch.tensor([0, 1], dtype=torch.int32),
            "end": torch.tensor([2, 3], dtype=torch.int32)}


REPLAY: list[Corruption] = [
    *[c for c in SLOT_CASES if not c[0].startswith(("fresh", "slot count"))], *CAPSULE_CASES,
    ("begin after end", _set("begin", lambda a: torch.tensor([3, 1], dtype=torch.int32)),
     r"begin/end: sequence 0: need 0 <= begin <= end <= capacity 3 \(got 3, 2\)"),
    ("end past the capacity", _set("end", lambda a: torch.tensor([2, 4], dtype=torch.int32)),
     r"begin/end: sequence 1"),
    ("end dtype", _set("end", lambda a: a["end"].long()), r"end: must be Int"),
    ("end count", _set("end", lambda a: a["end"][:1]),
     r"end: size\(0\) must equal the sequences of slots"),
    ("key head ratio", _set("key", lambda a: torch.zeros(S, CAP, 3, DK)),
     r"key: head ratio: the value heads \(4\) must be a multiple of the key heads"),
]


def _run_replay(a: Args) -> None:
    library().gated_delta_replay(*[a[n] for n in ("pool", "slots", "decay", "key", "delta",
                                                  "begin", "end")])


def _commit() -> Args:
    gen = torch.Generator().manual_seed(11)
    return {**_replay(), "conv": torch.randn(S, 5, 3, generator=gen).bfloat16(),
            "conv_caps": torch.randn(S, CAP, 5, generator=gen).bfloat16()}


COMMIT: list[Corruption] = [
    *REPLAY,
    ("conv capsule shape", _set("conv_caps", lambda a: a["conv_caps"][:, :, :4].contiguous()),
     r"conv_capsules: must be \[slots, capacity, channels\] = \[4, 3, 5\]"),
    ("conv capsule dtype", _set("conv_caps", lambda a: a["conv_caps"].float()),
     r"conv_capsules: must be BFloat16"),
    ("conv pool rows", _set("conv", lambda a: a["conv"][:3].contiguous()),
     r"conv_pools: size\(0\) must equal the recurrent pool's slots"),
    ("conv pool dtype", _set("conv", lambda a: a["conv"].double()),
     r"conv_pools: must be float32, bfloat16 or float16"),
    ("conv pool layout", _set("conv", lambda a: a["conv"].transpose(1, 2)),
     r"conv_pools: must be contiguous"),
    ("a layer short", lambda a: a.update(layers=2),
     r"pools: need one conv pool, conv capsule, recurrent pool, decay, key and delta per "
     r"linear layer \(got 1, 2, 2, 2, 2, 2\)"),
]


def _run_commit(a: Args) -> None:
    n = a.get("layers", 1)  # "a layer short": every list but the conv pools' has n entries
    library().commit_replay([a["conv"]], [a["conv_caps"]] * n, [a["pool"]] * n,
                            [a["decay"]] * n, [a["key"]] * n, [a["delta"]] * n, a["slots"],
                            a["begin"], a["end"])


def _run_gdn(a: Args) -> None:
    names = ["q", "k", "v", "a", "b", "a_log", "dt_bias", "pool", "slots", "fresh"]
    if "cu_seqlens" in a:
        library().gated_delta_varlen(*[a[n] for n in names], a["cu_seqlens"], a["out"],
                                     a["scale"])
    else:
        library().gated_delta_decode(*[a[n] for n in names], a["out"], a["scale"])


# -- the fused Gated DeltaNet decode mixer -------------------------------------------------------

QKV = 2 * HK * DK + HV * DV


def _mixer() -> Args:
    gen = torch.Generator().manual_seed(6)
    proj = torch.randn(2, QKV + HV * DV + 2 * HV, generator=gen)  # row views of one projection
    return {"qkv": proj[:, :QKV], "z": proj[:, QKV:QKV + HV * DV],
            "a": proj[:, QKV + HV * DV:QKV + HV * DV + HV], "b": proj[:, -HV:],
            "conv_weight": torch.randn(QKV, 4, generator=gen),
            "conv_pool": torch.randn(S, QKV, 3, generator=gen),
            "a_log": torch.randn(HV, generator=gen), "dt_bias": torch.randn(HV, generator=gen),
            "pool": torch.randn(S, HV, DV, DK, generator=gen), "slots": torch.tensor([3, 1]),
            "fresh": torch.tensor([False, True]), "norm_weight": torch.randn(DV, generator=gen),
            "out": torch.zeros(2, HV * DV), "key_heads": HK}


MIXER: list[Corruption] = [
    *SLOT_CASES,
    ("key heads", _set("key_heads", lambda a: 3),
     r"key_heads: head ratio: the value heads \(4\) must be a multiple of the key heads "
     r"\(got 3\)"),
    ("qkv width", _set("qkv", lambda a: a["qkv"][:, 1:]),
     r"qkv: size\(1\) must equal 2 key_heads Dk \+ Hv Dv = 64"),
    ("qkv dtype", lambda a: a.update({k: a[k].double() for k in ("qkv", "z", "a", "b")}),
     r"qkv: dtype must be float32 or bfloat16 \(got Double\)"),
    ("z columns strided", _set("z", lambda a: torch.randn(2, 2 * HV * DV)[:, ::2]),
     r"z: rows must be contiguous"),
    ("a dtype", _set("a", lambda a: a["a"].bfloat16()), r"a: must be Float \(got BFloat16\)"),
    ("conv pool rows", _set("conv_pool", lambda a: torch.randn(S + 1, QKV, 3)),
     r"conv_pool: must have the recurrent pool's 4 rows"),
    ("conv weight channels", _set("conv_weight", lambda a: torch.randn(QKV - 1, 4)),
     r"conv_weight: size\(0\) must equal the channels of qkv"),
    ("norm weight size", _set("norm_weight", lambda a: torch.randn(DV + 1)),
     r"norm_weight: size\(0\) must equal the value head size of pool"),
    ("out dtype", _set("out", lambda a: a["out"].bfloat16()), r"out: must be Float"),
    ("verify without cu_seqlens", _set("verify", lambda a: torch.tensor([True, False])),
     r"verify: needs cu_seqlens"),
    ("verify without capsule", lambda a: a.update(
        cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
        verify=torch.tensor([False, False])), r"capsule: verify chunks need capsule_conv"),
    ("verify chunk over the capacity", lambda a: a.update(
        cu_seqlens=torch.tensor([0, 2, 2], dtype=torch.int32), fresh=torch.tensor([False, False]),
        verify=torch.tensor([True, False]), capsule_conv=torch.zeros(S, 1, QKV),
        decay=torch.zeros(S, 1, HV), key=torch.zeros(S, 1, HK, DK),
        delta=torch.zeros(S, 1, HV, DV)),
     r"cu_seqlens: verify chunk 0 has 2 tokens, more than the capsule's capacity 1"),
]
MIXER_OPTIONAL = ("cu_seqlens", "verify", "capsule_conv", "decay", "key", "delta")


def _run_mixer(a: Args) -> None:
    names = ["qkv", "z", "a", "b", "conv_weight", "conv_pool", "a_log", "dt_bias", "pool",
             "slots", "fresh", "norm_weight", "out", "key_heads"]
    library().gdn_decode_mixer(*[a[n] for n in names], DK ** -0.5, 1e-6, 1e-6,
                               **{k: a[k] for k in MIXER_OPTIONAL if k in a})


# -- whole decoder layers of a decode step --------------------------------------------------------

HID, INTER = 16, 12


def _tail(gen: torch.Generator) -> Args:
    return {"post_norm": torch.randn(HID, generator=gen),
            "gate_proj": torch.randn(INTER, HID, generator=gen),
            "up_proj": torch.randn(INTER, HID, generator=gen),
            "down_proj": torch.randn(HID, INTER, generator=gen)}


def _gdn_layer() -> Args:
    gen = torch.Generator().manual_seed(7)
    return {"h": torch.randn(2, HID, generator=gen), "input_norm": torch.randn(HID, generator=gen),
            "in_proj_qkv": torch.randn(QKV, HID, generator=gen),
            "in_proj_z": torch.randn(HV * DV, HID, generator=gen),
            "in_proj_b": torch.randn(HV, HID, generator=gen),
            "in_proj_a": torch.randn(HV, HID, generator=gen),
            "conv_weight": torch.randn(QKV, 4, generator=gen),
            "conv_pool": torch.randn(S, QKV, 3, generator=gen),
            "a_log": torch.randn(HV, generator=gen), "dt_bias": torch.randn(HV, generator=gen),
            "pool": torch.randn(S, HV, DV, DK, generator=gen), "slots": torch.tensor([3, 1]),
            "fresh": torch.tensor([False, True]), "gated_norm": torch.randn(DV, generator=gen),
            "out_proj": torch.randn(HID, HV * DV, generator=gen), **_tail(gen),
            "key_heads": HK, "out": None}


def _run_gdn_layer(a: Args) -> None:
    names = ["h", "input_norm", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
             "conv_weight", "conv_pool", "a_log", "dt_bias", "pool", "slots", "fresh",
             "gated_norm", "out_proj", "post_norm", "gate_proj", "up_proj", "down_proj",
             "key_heads"]
    a["out"] = library().gdn_decode_layer(*[a[n] for n in names], DK ** -0.5, 1e-6, 1e-6, 1e-6,
                                          True, a.get("quant", []), 4)


_IN_MIXER = r"in pagedhybrid\.gdn_decode_mixer: "
GDN_LAYER: list[Corruption] = [
    *[(name, mutate, _IN_MIXER + message) for name, mutate, message in SLOT_CASES],
    ("h dtype", lambda a: a.update(h=a["h"].double()),
     r"h: dtype must be float32 or bfloat16 \(got Double\)"),
    ("in_proj_qkv rows", _set("in_proj_qkv", lambda a: a["in_proj_qkv"][1:].contiguous()),
     r"in_proj_qkv: size\(0\) must equal the channels of conv_weight = 64"),
    ("in_proj_b dtype", _set("in_proj_b", lambda a: a["in_proj_b"].bfloat16()),
     r"in_proj_b: must be Float \(got BFloat16\)"),
    ("key heads", _set("key_heads", lambda a: 3), _IN_MIXER + r"key_heads: head ratio"),
    ("out_proj width", _set("out_proj", lambda a: torch.randn(HID, HV * DV + 1)),
     r"out_proj: size\(1\) must equal the mixer's output width = 32"),
    ("up rows", _set("up_proj", lambda a: torch.randn(INTER + 1, HID)),
     r"up: size\(0\) must equal down.size\(1\) = 12"),
    ("down dtype", _set("down_proj", lambda a: a["down_proj"].bfloat16()),
     r"down: must be Float"),
    ("post norm size", _set("post_norm", lambda a: torch.randn(HID + 1)),
     r"post_norm: size\(0\) must equal the hidden size of h"),
    ("input norm size", _set("input_norm", lambda a: torch.randn(HID - 1)),
     r"in pagedhybrid\.rms_norm: w: size\(0\) must equal x.size\(1\)"),
]

RD = 8  # rotary dims


def _attention_layer() -> Args:
    gen = torch.Generator().manual_seed(8)
    a = _attention()
    return {"h": torch.randn(2, HID, generator=gen), "input_norm": torch.randn(HID, generator=gen),
            "q_proj": torch.randn(2 * HQ * D, HID, generator=gen),
            "k_proj": torch.randn(HKV * D, HID, generator=gen),
            "v_proj": torch.randn(HKV * D, HID, generator=gen),
            "q_norm": torch.randn(D, generator=gen), "k_norm": torch.randn(D, generator=gen),
            "cos": torch.randn(2, RD, generator=gen), "sin": torch.randn(2, RD, generator=gen),
            "key_cache": a["key_cache"], "value_cache": a["value_cache"],
            "write_slots": torch.tensor([4 * BS + 4, 2 * BS + 3]),
            "block_table": a["block_table"], "cu_seqlens": torch.tensor([0, 1, 2],
                                                                         dtype=torch.int32),
            "past_lens": torch.tensor([20, 3], dtype=torch.int32), "seqs": a["seqs"],
            "o_proj": torch.randn(HID, HQ * D, generator=gen), **_tail(gen),
            "heads": HQ, "kv_heads": HKV, "out": None}


def _run_attention_layer(a: Args) -> None:
    names = ["h", "input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "cos", "sin",
             "key_cache", "value_cache", "write_slots", "block_table", "cu_seqlens", "past_lens",
             "seqs", "o_proj", "post_norm", "gate_proj", "up_proj", "down_proj", "heads",
             "kv_heads"]
    a["out"] = library().attention_decode_layer(*[a[n] for n in names], D ** -0.5, 1e-6,
                                                KV_SPLIT, True, a.get("quant", []), 4)


_IN_ATTENTION = r"in pagedhybrid\.paged_attention: "
ATTENTION_LAYER: list[Corruption] = [
    ("page past the pool", _table(0, 1, P), _IN_ATTENTION + r"block_table: block_table\[0\]\[1\]"),
    ("negative page", _table(1, 0, -1), _IN_ATTENTION + r"block_table: block_table\[1\]\[0\]"),
    ("write slot past the pages", _set("write_slots", lambda a: torch.tensor([0, P * BS])),
     r"write_slots: write_slots\[1\] = 96 is outside the pages' 96 slots"),
    ("write slot dtype", _set("write_slots", lambda a: a["write_slots"].int()),
     r"write_slots: must be Long"),
    ("head ratio", _set("heads", lambda a: 3), r"heads: head ratio"),
    ("q_proj rows", _set("q_proj", lambda a: a["q_proj"][1:].contiguous()),
     r"q_proj: size\(0\) must equal 2 heads D \(query \| gate\) = 256"),
    ("v_proj columns", _set("v_proj", lambda a: torch.randn(HKV * D, HID + 1)),
     r"v_proj: size\(1\) must equal the hidden size of h = 16"),
    ("cos width", lambda a: a.update(cos=torch.randn(2, 7), sin=torch.randn(2, 7)),
     r"cos: cos and sin must be \[N, rotary_dim\]"),
    ("cache dtype", lambda a: a.update(key_cache=a["key_cache"].bfloat16(),
                                       value_cache=a["value_cache"].bfloat16()),
     r"key_cache: must be \[P, bs, Hkv, D\] pages of h's dtype"),
    ("o_proj width", _set("o_proj", lambda a: torch.randn(HID, HQ * D - 1)),
     r"o_proj: size\(1\) must equal the mixer's output width = 128"),
    ("value cache shape", _set("value_cache", lambda a: a["value_cache"][:-1].contiguous()),
     _IN_ATTENTION + r"value_cache"),
    ("cos dtype", lambda a: a.update(cos=a["cos"].double(), sin=a["sin"].double()),
     r"cos: must be Float"),
    ("sin layout", _set("sin", lambda a: torch.randn(RD, 2).t()), r"sin: must be contiguous"),
    ("k_norm size", _set("k_norm", lambda a: torch.randn(D + 1)),
     r"k_norm: size\(0\) must equal the head size D"),
]


def _head_input() -> Args:
    gen = torch.Generator().manual_seed(12)
    return {"token_ids": torch.tensor([5, 0, 9]), "hidden": torch.randn(3, HID, generator=gen),
            "embed": torch.randn(10, HID, generator=gen),
            "norm_embedding": torch.randn(HID, generator=gen),
            "norm_hidden": torch.randn(HID, generator=gen),
            "fc": torch.randn(HID, 2 * HID, generator=gen), "out": None}


def _run_head_input(a: Args) -> None:
    a["out"] = library().mtp_head_input(*[a[n] for n in ("token_ids", "hidden", "embed",
                                                         "norm_embedding", "norm_hidden", "fc")],
                                        1e-6, True, [], 4)


HEAD_INPUT: list[Corruption] = [
    ("token past the vocabulary", _set("token_ids", lambda a: torch.tensor([5, 10, 9])),
     r"token_ids: token_ids\[1\] = 10 is outside the vocabulary \[0, 10\)"),
    ("negative token", _set("token_ids", lambda a: torch.tensor([-1, 0, 9])),
     r"token_ids: token_ids\[0\] = -1"),
    ("token count", _set("token_ids", lambda a: torch.tensor([5, 0])),
     r"token_ids: size\(0\) must equal the rows of hidden"),
    ("token dtype", _set("token_ids", lambda a: a["token_ids"].int()), r"token_ids: must be Long"),
    ("hidden dtype", _set("hidden", lambda a: a["hidden"].double()),
     r"hidden: dtype must be float32 or bfloat16"),
    ("embed width", _set("embed", lambda a: torch.randn(10, HID + 1)),
     r"embed: size\(1\) must equal the hidden size of hidden"),
    ("embed dtype", _set("embed", lambda a: a["embed"].bfloat16()), r"embed: must be Float"),
    ("norm size", _set("norm_hidden", lambda a: torch.randn(HID - 1)),
     r"norm_hidden: size\(0\) must equal the hidden size"),
    ("fc columns", _set("fc", lambda a: torch.randn(HID, HID)),
     r"fc: size\(1\) must equal twice the hidden size = 32"),
    ("fc rows", _set("fc", lambda a: torch.randn(HID + 2, 2 * HID)),
     r"fc: size\(0\) must equal the hidden size of hidden = 16"),
]


# -- causal conv ---------------------------------------------------------------------------------

C, K = 6, 4


def _conv(varlen: bool) -> Args:
    gen = torch.Generator().manual_seed(2)
    t = 3 if varlen else 2
    a = {"x": torch.randn(t, C, generator=gen), "weight": torch.randn(C, K, generator=gen),
         "bias": torch.randn(C, generator=gen), "pool": torch.randn(S, C, K - 1, generator=gen),
         "slots": torch.tensor([3, 1]), "fresh": torch.tensor([False, True]),
         "out": torch.zeros(t, C), "silu": True}
    if varlen:
        a["cu_seqlens"] = torch.tensor([0, 2, 3], dtype=torch.int32)
    return a


CONV: list[Corruption] = [
    *SLOT_CASES,
    ("x dims", _set("x", lambda a: a["x"][None]), r"x: must be \[T, C\]"),
    ("x dtype", lambda a: a.update({k: a[k].double() for k in ("x", "weight", "bias", "pool",
                                                                "out")}),
     r"x: dtype must be float32, bfloat16 or float16 \(got Double\)"),
    ("weight dtype", _set("weight", lambda a: a["weight"].bfloat16()),
     r"weight: must be Float \(got BFloat16\)"),
    ("weight channels", _set("weight", lambda a: torch.randn(C + 1, K)),
     r"weight: size\(0\) must equal the channels of x = 6"),
    ("bias channels", _set("bias", lambda a: torch.randn(C - 1)),
     r"bias: size\(0\) must equal the channels of x"),
    ("pool width", _set("pool", lambda a: torch.randn(S, C, K)),
     r"pool: size\(2\) must equal the kernel width - 1 = 3"),
    ("pool not contiguous", _set("pool", lambda a: torch.randn(S, K - 1, C).transpose(1, 2)),
     r"pool: must be contiguous"),
    ("out shape", _set("out", lambda a: torch.zeros(1, C)), r"out: must have x's shape"),
]
CONV_VARLEN: list[Corruption] = [
    *CONV,
    ("cu end", _set("cu_seqlens", lambda a: torch.tensor([0, 1, 2], dtype=torch.int32)),
     r"cu_seqlens: cu_seqlens\[2\] must equal the number of token rows 3 \(got 2\)"),
    ("cu length", _set("cu_seqlens", lambda a: torch.tensor([0, 3], dtype=torch.int32)),
     r"slots: size\(0\) must equal the number of sequences = 1"),
]


def _run_conv(a: Args) -> None:
    names = ["x", "weight", "bias", "pool", "slots", "fresh"]
    if "cu_seqlens" in a:
        library().causal_conv_varlen(*[a[n] for n in names], a["cu_seqlens"], a["out"],
                                     a["silu"])
    else:
        library().causal_conv_decode(*[a[n] for n in names], a["out"], a["silu"])


# -- linear and pointwise ------------------------------------------------------------------------


def _linear() -> Args:
    gen = torch.Generator().manual_seed(3)
    return {"x": torch.randn(3, 20, generator=gen), "w": torch.randn(5, 20, generator=gen),
            "out": torch.zeros(3, 5)}


LINEAR: list[Corruption] = [
    ("x dtype", _set("x", lambda a: a["x"].double()),
     r"x: dtype must be float32, bfloat16 or float16 \(got Double\)"),
    ("x dims", _set("x", lambda a: a["x"].flatten()), r"x: must be \[M, K\]"),
    ("w dtype", _set("w", lambda a: a["w"].double()),
     r"w: dtype must be x's \(Float\), or bfloat16 / float16 with float32 x \(got Double\)"),
    ("w dtype under bf16 x", lambda a: a.update(x=a["x"].bfloat16(), out=a["out"].bfloat16()),
     r"w: dtype must be x's \(BFloat16\).*\(got Float\)"),
    ("w columns", _set("w", lambda a: torch.randn(5, 21)),
     r"w: size\(1\) must equal the columns K of x = 20"),
    ("out dtype", _set("out", lambda a: a["out"].bfloat16()),
     r"out: must be Float \(got BFloat16\)"),
    ("out rows", _set("out", lambda a: torch.zeros(4, 5)),
     r"out: size\(0\) must equal the rows M of x = 3"),
    ("out columns", _set("out", lambda a: torch.zeros(3, 6)),
     r"out: size\(1\) must equal the rows N of w = 5"),
    ("w not contiguous", _set("w", lambda a: torch.randn(20, 5).t()), r"w: must be contiguous"),
    ("x not contiguous", _set("x", lambda a: torch.randn(20, 3).t()), r"x: must be contiguous"),
]


def _run_linear(a: Args) -> None:
    library().linear_invariant(a["x"], a["w"], a["out"])


def _moe() -> Args:
    gen = torch.Generator().manual_seed(8)
    return {"x": torch.randn(5, 12, generator=gen),
            "index": torch.tensor([[0, 3], [1, 2], [3, 0], [2, 2], [1, 0]]),
            "weights": torch.rand(5, 2, generator=gen),
            "gate_up": torch.randn(4, 10, 12, generator=gen),
            "down": torch.randn(4, 12, 5, generator=gen),
            "sg": torch.randn(6, 12, generator=gen), "su": torch.randn(6, 12, generator=gen),
            "sd": torch.randn(12, 6, generator=gen), "gate": torch.randn(1, 12, generator=gen),
            "out": torch.zeros(5, 12), "invariant": False}


def _run_moe(a: Args) -> None:
    shared = [a[n] for n in ("sg", "su", "sd", "gate")]
    library().moe_experts(a["x"], a["index"], a["weights"], a["gate_up"], a["down"], *shared,
                          a["out"], a["invariant"])


def _index(t: int, j: int, e: int) -> Callable[[Args], None]:
    def mutate(a: Args) -> None:
        a["index"] = a["index"].clone()
        a["index"][t, j] = e

    return mutate


MOE: list[Corruption] = [
    ("x dtype", _set("x", lambda a: a["x"].double()),
     r"x: dtype must be float32, bfloat16 or float16 \(got Double\)"),
    ("gate_up dims", _set("gate_up", lambda a: a["gate_up"][0]), r"gate_up: must be \[E, 2I, H\]"),
    ("gate_up odd rows", _set("gate_up", lambda a: torch.randn(4, 9, 12)),
     r"gate_up: must be \[E >= 1, 2I \(even, >= 2\), H\]"),
    ("gate_up dtype under bf16 x", lambda a: a.update(x=a["x"].bfloat16(),
                                                      out=a["out"].bfloat16()),
     r"gate_up: dtype must be x's \(BFloat16\)"),
    ("down experts", _set("down", lambda a: torch.randn(3, 12, 5)),
     r"down: size\(0\) must equal the number of experts E of gate_up = 4"),
    ("down channels", _set("down", lambda a: torch.randn(4, 12, 6)),
     r"down: size\(2\) must equal the intermediate size I of gate_up = 5"),
    ("index above E", _index(3, 1, 4), r"index: index\[3, 1\] = 4 is outside the experts"),
    ("index negative", _index(0, 0, -1), r"index: index\[0, 0\] = -1 is outside"),
    ("index dtype", _set("index", lambda a: a["index"].int()), r"index: must be Long"),
    ("top-k above E", _set("index", lambda a: torch.zeros(5, 5, dtype=torch.int64)),
     r"index: top-k \(size\(1\)\) must be in \[1, min\(E, 64\)\] \(got 5, E = 4\)"),
    ("weights columns", _set("weights", lambda a: torch.rand(5, 3)),
     r"weights: size\(1\) must equal the top-k of index = 2"),
    ("weights dtype", _set("weights", lambda a: a["weights"].double()), r"weights: must be Float"),
    ("shared partly given", _set("sd", lambda a: None),
     r"shared_\*: the shared expert needs all four weights or none \(got 3\)"),
    ("shared down shape", _set("sd", lambda a: torch.randn(12, 7)),
     r"shared_down_proj: size\(1\) must equal shared_gate_proj's rows = 6"),
    ("shared gate rows", _set("gate", lambda a: torch.randn(2, 12)),
     r"shared_gate: size\(0\) must equal 1 = 1"),
    ("out rows", _set("out", lambda a: torch.zeros(4, 12)),
     r"out: size\(0\) must equal the rows T of x = 5"),
    ("x not contiguous", _set("x", lambda a: torch.randn(12, 5).t()), r"x: must be contiguous"),
]


def _quant() -> Args:
    from pagedhybrid.weightquant import WeightFormat, quantize

    gen = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(6, 80, generator=gen), WeightFormat.parse("int4:32:asym"))
    return {"x": torch.randn(3, 80, generator=gen), "codes": q.codes, "scales": q.scales,
            "zeros": q.zeros, "bits": 4, "out": torch.zeros(3, 6), "row0": 1,
            "rows": torch.zeros(4, 80)}


def _run_quant(a: Args) -> None:
    library().quant_linear(a["x"], a["codes"], a["scales"], a["zeros"], a["bits"], a["out"])


def _run_dequant(a: Args) -> None:
    library().quant_dequantize(a["codes"], a["scales"], a["zeros"], a["bits"], a["row0"],
                               a["rows"])


def _grouped(then: Callable[[Args], None]) -> Callable[[Args], None]:
    """The weight in the engine's groups of 16 rows, then ``then``."""
    def mutate(a: Args) -> None:
        from pagedhybrid.weightquant import WeightFormat, group_rows, quantize

        q = group_rows(quantize(torch.randn(16, 80, generator=torch.Generator().manual_seed(8)),
                                WeightFormat.parse("int4:32:asym")))
        a.update(codes=q.codes, scales=q.scales, zeros=q.zeros, out=torch.zeros(3, 16))
        then(a)

    return mutate


QUANT_WEIGHT: list[Corruption] = [
    ("bits", _set("bits", lambda a: 3), r"bits: must be 4 or 8 \(got 3\)"),
    ("grouped lines", _grouped(_set("codes", lambda a: a["codes"].view(1, 3, 16, 16))),
     r"codes: grouped codes must be \[N / 16, blocks, block \* bits / 32, 64\]"),
    ("grouped scales", _grouped(_set("scales", lambda a: a["scales"].flatten(1))),
     r"scales: must have 3 dimensions"),
    ("grouped zeros", _grouped(_set("zeros", lambda a: a["zeros"][:, :, :8].contiguous())),
     r"zeros: size\(2\) must equal the rows of a group = 16"),
    ("codes dtype", _set("codes", lambda a: a["codes"].to(torch.int8)), r"codes: must be Byte"),
    ("codes dims", _set("codes", lambda a: a["codes"].flatten(1)),
     r"codes: must have 3 dimensions"),
    ("scales dtype", _set("scales", lambda a: a["scales"].float()), r"scales: must be Half"),
    ("scales blocks", _set("scales", lambda a: a["scales"][:, :2].contiguous()),
     r"scales: size\(1\) must equal the blocks of codes = 3"),
    ("zeros rows", _set("zeros", lambda a: a["zeros"][:5].contiguous()),
     r"zeros: size\(0\) must equal the rows N of codes = 6"),
]
QUANT: list[Corruption] = [
    *QUANT_WEIGHT,
    ("x dtype", _set("x", lambda a: a["x"].double()),
     r"x: must be float32, bfloat16 or float16 \(got Double\)"),
    ("block not a multiple of 32", _set("codes", lambda a: a["codes"].view(6, 6, 8)),
     r"codes: size\(2\) \* 8 / bits \(the block\) must be a multiple of 32"),
    ("K beyond the blocks", _set("x", lambda a: torch.randn(3, 97)),
     r"codes: must hold K = 97 columns in size\(1\) blocks of 32"),
    ("K a block short", _set("x", lambda a: torch.randn(3, 64)),
     r"codes: must hold K = 64 columns"),
    ("out dtype", _set("out", lambda a: a["out"].bfloat16()), r"out: must be Float"),
    ("out columns", _set("out", lambda a: torch.zeros(3, 5)),
     r"out: size\(1\) must equal the rows N of codes = 6"),
    ("x not contiguous", _set("x", lambda a: torch.randn(80, 3).t()), r"x: must be contiguous"),
]
DEQUANT: list[Corruption] = [
    *QUANT_WEIGHT,
    ("rows past N", _set("row0", lambda a: 3), r"row0: rows \[row0, row0 \+ out.size\(0\)\)"),
    ("negative row0", _set("row0", lambda a: -1), r"row0: rows"),
    ("out K", _set("rows", lambda a: torch.zeros(4, 50)),
     r"out: size\(1\) must be the K the codes hold"),
    ("out dtype", _set("rows", lambda a: a["rows"].half()), r"out: must be Float"),
]


def _pointwise() -> Args:
    return {"x": torch.randn(4, 7, generator=torch.Generator().manual_seed(4)),
            "out": torch.zeros(4, 7)}


POINTWISE: list[Corruption] = [
    ("numel", _set("out", lambda a: torch.zeros(27)), r"out: must have x's 28 elements"),
    ("dtype", _set("x", lambda a: a["x"].half()), r"x: must be Float \(got Half\)"),
    ("out not contiguous", _set("out", lambda a: torch.zeros(7, 4).t()),
     r"out: must be contiguous"),
]

def _greedy() -> Args:
    return {"logits": torch.randn(3, 37, generator=torch.Generator().manual_seed(6)),
            "out": torch.zeros(3, dtype=torch.int64)}


def _bitmask() -> Args:
    """A grammar's packed mask over 37 tokens (two int32 words a row), and logits for it."""
    return {"logits": torch.randn(3, 37, generator=torch.Generator().manual_seed(6)),
            "allowed": torch.tensor([[-1, 31], [0x5555, 0], [0, 16]], dtype=torch.int32),
            "out": torch.zeros(3, dtype=torch.int64)}


def _top() -> Args:
    return {"logits": torch.randn(3, 37, generator=torch.Generator().manual_seed(6)),
            "rows": [2, 0], "k": 5, "out": torch.zeros(2, 5, dtype=torch.int64)}


TOP: list[Corruption] = [
    ("logits dtype", _set("logits", lambda a: a["logits"].bfloat16()),
     r"logits: must be Float \(got BFloat16\)"),
    ("k of none", _set("k", lambda a: 0), r"k: must be in \[1, 37\] \(got 0\)"),
    ("k past the vocabulary", _set("k", lambda a: 38), r"k: must be in \[1, 37\] \(got 38\)"),
    ("row past the logits", _set("rows", lambda a: [0, 3]),
     r"rows: must index the 3 rows of logits \(got 3\)"),
    ("negative row", _set("rows", lambda a: [-1]),
     r"rows: must index the 3 rows of logits \(got -1\)"),
]


BITMASK: list[Corruption] = [
    ("allowed dtype", _set("allowed", lambda a: a["allowed"].long()),
     r"allowed: must be Int \(got Long\)"),
    ("allowed too narrow", _set("allowed", lambda a: a["allowed"][:, :1].contiguous()),
     r"allowed: must be int32 \[R, ceil\(V / 32\)\] for logits \[3, 37\]"),
    ("allowed rows", _set("allowed", lambda a: a["allowed"][:2].contiguous()),
     r"allowed: must be int32 \[R, ceil\(V / 32\)\]"),
    ("allowed not contiguous", _set("allowed", lambda a: torch.zeros(2, 3, dtype=torch.int32)
                                    .t()), r"allowed: must be contiguous"),
    ("logits dtype", _set("logits", lambda a: a["logits"].bfloat16()),
     r"logits: must be Float \(got BFloat16\)"),
]


def _apply_bitmask(a: Args) -> None:
    library().apply_token_bitmask_(a["logits"], a["allowed"])
    a["out"].copy_(a["logits"].argmax(dim=-1))


GREEDY: list[Corruption] = [
    ("logits dtype", _set("logits", lambda a: a["logits"].bfloat16()),
     r"logits: must be Float \(got BFloat16\)"),
    ("logits dims", _set("logits", lambda a: a["logits"].flatten()),
     r"logits: must have 2 dimensions"),
    ("logits not contiguous", _set("logits", lambda a: torch.randn(37, 3).t()),
     r"logits: must be contiguous"),
    ("no columns", _set("logits", lambda a: torch.zeros(3, 0)),
     r"logits: must have at least one column"),
]


def _norm() -> Args:
    gen = torch.Generator().manual_seed(5)
    return {"x": torch.randn(3, 12, generator=gen), "gate": torch.randn(3, 12, generator=gen),
            "w": torch.randn(12, generator=gen), "out": torch.zeros(3, 12)}


NORM: list[Corruption] = [
    ("x dtype", _set("x", lambda a: a["x"].double()), r"x: must be float32 or bfloat16"),
    ("x dims", _set("x", lambda a: a["x"].flatten()), r"x: must have 2 dimensions"),
    ("x not contiguous", _set("x", lambda a: torch.randn(12, 3).t()), r"x: must be contiguous"),
    ("out rows", _set("out", lambda a: torch.zeros(4, 12)), r"out: size\(0\) must equal"),
    ("out dtype", _set("out", lambda a: a["out"].bfloat16()), r"out: must be Float"),
]
WEIGHTED: list[Corruption] = [
    *NORM,
    ("w size", _set("w", lambda a: torch.randn(11)), r"w: size\(0\) must equal x.size\(1\)"),
    ("w dtype", _set("w", lambda a: a["w"].half()), r"w: must be float32 or bfloat16"),
]
GATED: list[Corruption] = [
    *WEIGHTED,
    ("gate shape", _set("gate", lambda a: torch.randn(3, 11)), r"gate: size\(1\) must equal"),
    ("gate dtype", _set("gate", lambda a: a["gate"].bfloat16()), r"gate: must be Float"),
]

def _head_output() -> Args:
    gen = torch.Generator().manual_seed(13)
    return {"h": torch.randn(3, HID, generator=gen), "norm": torch.randn(HID, generator=gen),
            "picks": torch.tensor([2, 0]), "lm_head": torch.randn(10, HID, generator=gen),
            "out": None}


def _run_head_output(a: Args) -> None:
    out, ids = library().mtp_head_output(a["h"], a["norm"], 1e-6, a["picks"], a["lm_head"],
                                         True, [], 4)
    a["out"] = torch.cat([out.flatten(), ids.float()])


HEAD_OUTPUT: list[Corruption] = [
    ("pick past the rows", _set("picks", lambda a: torch.tensor([2, 3])),
     r"picks: picks\[1\] = 3 is outside the rows of h \[0, 3\)"),
    ("pick dtype", _set("picks", lambda a: a["picks"].int()), r"picks: must be Long"),
    ("h dtype", _set("h", lambda a: a["h"].double()), r"h: dtype must be float32 or bfloat16"),
    ("norm size", _set("norm", lambda a: torch.randn(HID + 1)),
     r"norm: size\(0\) must equal the hidden size of h"),
    ("lm_head width", _set("lm_head", lambda a: torch.randn(10, HID - 1)),
     r"lm_head: size\(1\) must equal the hidden size of h = 16"),
    ("lm_head dtype", _set("lm_head", lambda a: a["lm_head"].bfloat16()),
     r"lm_head: must be Float"),
]


def _chain() -> Args:
    gen = torch.Generator().manual_seed(14)
    layer = _attention_layer()
    del layer["h"], layer["cos"], layer["sin"], layer["write_slots"], layer["cu_seqlens"]
    del layer["past_lens"], layer["seqs"], layer["out"]
    n = 40  # rope table rows
    return {**layer, **{k: v for k, v in _head_input().items() if k != "out"},
            "token_ids": torch.tensor([5, 0]), "hidden": torch.randn(2, HID, generator=gen),
            "positions": torch.tensor([20, 3]), "steps": torch.tensor([3, 1]),
            "block_table": torch.tensor([[4, 1], [2, -1]], dtype=torch.int32),
            "cos": torch.randn(n, RD, generator=gen), "sin": torch.randn(n, RD, generator=gen),
            "final_norm": torch.randn(HID, generator=gen),
            "lm_head": torch.randn(10, HID, generator=gen), "out": None}


def _head(a: Args) -> list[Any]:
    """The MTP head's arguments of mtp_chain / mtp_draft after the rope tables."""
    return [*[a[n] for n in ("embed", "norm_embedding", "norm_hidden", "fc")], [],
            *[a[n] for n in ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm",
                             "key_cache", "value_cache", "o_proj", "post_norm", "gate_proj",
                             "up_proj", "down_proj", "heads", "kv_heads")],
            D ** -0.5, 1e-6, KV_SPLIT, [], a["final_norm"], a["lm_head"], [], 4, True]


def _run_chain(a: Args) -> None:
    drafts, state = library().mtp_chain(
        *[a[n] for n in ("token_ids", "hidden", "positions", "steps", "block_table")], BS,
        a["cos"], a["sin"], *_head(a))
    a["out"] = torch.cat([drafts.flatten().float(), state.flatten()])


CHAIN: list[Corruption] = [
    ("chain past its pages", _set("steps", lambda a: torch.tensor([13, 1])),
     r"block_table: sequence 0: position 32 needs page 2 of a table of 2"),
    ("negative steps", _set("steps", lambda a: torch.tensor([3, -1])),
     r"steps: sequence 1: steps and positions must be >= 0"),
    ("steps count", _set("steps", lambda a: torch.tensor([3])),
     r"steps: size\(0\) must equal the chains = 2"),
    ("position dtype", _set("positions", lambda a: a["positions"].int()),
     r"positions: must be Long"),
    ("rope table short", lambda a: a.update(cos=a["cos"][:21].contiguous(),
                                            sin=a["sin"][:21].contiguous()),
     r"cos: sequence 0: position 22 is past the rope table's 21 rows"),
    ("table dtype", _set("block_table", lambda a: a["block_table"].long()),
     r"block_table: must be Int"),
    ("page past the pool", _set("block_table", lambda a: torch.tensor([[4, P], [2, -1]],
                                                                       dtype=torch.int32)),
     r"block_table: sequence 0: page 1 = 6 is outside the page pool \[0, 6\)"),
    ("token past the vocabulary", _set("token_ids", lambda a: torch.tensor([5, 10])),
     r"token_ids: token_ids\[1\] = 10 is outside the vocabulary \[0, 10\)"),
    ("lm_head width", _set("lm_head", lambda a: torch.randn(10, HID + 1)),
     r"lm_head: size\(1\) must equal the hidden size of h"),
    ("q_proj rows", _set("q_proj", lambda a: a["q_proj"][1:].contiguous()),
     r"in pagedhybrid\.attention_decode_layer: q_proj"),
]


def _draft() -> Args:
    a = _chain()
    gen = torch.Generator().manual_seed(15)
    # the catch-up: sequence 0 verifies 3 rows from position 17, sequence 1 decodes at 3
    return {**a, "token_ids": torch.tensor([5, 0, 9, 2]),
            "hidden": torch.randn(4, HID, generator=gen), "q_lens": torch.tensor([3, 1]),
            "past_lens": torch.tensor([17, 3]), "catch_table": a["block_table"],
            "picks": torch.tensor([2, 3])}


def _run_draft(a: Args) -> None:
    drafts, state = library().mtp_draft(
        *[a[n] for n in ("token_ids", "hidden", "q_lens", "past_lens", "catch_table", "picks",
                         "positions", "steps", "block_table")], BS, a["cos"], a["sin"],
        *_head(a))
    a["out"] = torch.cat([drafts.flatten().float(), state.flatten()])


DRAFT: list[Corruption] = [
    *[c for c in CHAIN if not c[0].startswith("token")],
    ("rows and q_lens", _set("q_lens", lambda a: torch.tensor([2, 1])),
     r"q_lens: must sum to the rows of hidden \(4; got 3\)"),
    ("empty catch-up sequence", _set("q_lens", lambda a: torch.tensor([4, 0])),
     r"q_lens: sequence 1: need q_lens >= 1"),
    ("pick past the rows", _set("picks", lambda a: torch.tensor([2, 4])),
     r"picks: picks\[1\] = 4 is outside the rows of hidden \[0, 4\)"),
    ("catch-up past its pages", _set("past_lens", lambda a: torch.tensor([30, 3])),
     r"block_table: sequence 0: position 32 needs page 2 of a table of 2"),
    ("catch-up table rows", _set("catch_table", lambda a: a["catch_table"][:1].contiguous()),
     r"catch_table: size\(0\) must equal the sequences of q_lens"),
    ("token past the vocabulary", _set("token_ids", lambda a: torch.tensor([5, 0, 9, 10])),
     r"token_ids: token_ids\[3\] = 10 is outside the vocabulary \[0, 10\)"),
]


OPS: dict[str, tuple[Callable[[], Args], Callable[[Args], None], list[Corruption], str]] = {
    "paged_attention": (_attention, _run_attention, ATTENTION, "out"),
    "gated_delta_decode": (lambda: _gdn(False), _run_gdn, GDN, "pool"),
    "gated_delta_varlen": (lambda: _gdn(True), _run_gdn, GDN_VARLEN, "pool"),
    "gated_delta_capture": (_capture, _run_capture, CAPTURE, "out"),
    "gated_delta_replay": (_replay, _run_replay, REPLAY, "pool"),
    "commit_replay": (_commit, _run_commit, COMMIT, "pool"),
    "gdn_decode_mixer": (_mixer, _run_mixer, MIXER, "pool"),
    "gdn_decode_layer": (_gdn_layer, _run_gdn_layer, GDN_LAYER, "pool"),
    "attention_decode_layer": (_attention_layer, _run_attention_layer, ATTENTION_LAYER,
                               "key_cache"),
    "mtp_head_input": (_head_input, _run_head_input, HEAD_INPUT, "out"),
    "mtp_head_output": (_head_output, _run_head_output, HEAD_OUTPUT, "out"),
    "mtp_chain": (_chain, _run_chain, CHAIN, "out"),
    "mtp_draft": (_draft, _run_draft, DRAFT, "out"),
    "causal_conv_decode": (lambda: _conv(False), _run_conv, CONV, "pool"),
    "causal_conv_varlen": (lambda: _conv(True), _run_conv, CONV_VARLEN, "pool"),
    "linear_invariant": (_linear, _run_linear, LINEAR, "out"),
    "linear": (_linear, lambda a: library().linear(a["x"], a["w"], a["out"]), LINEAR, "out"),
    "moe_experts": (_moe, _run_moe, MOE, "out"),
    "quant_linear": (_quant, _run_quant, QUANT, "out"),
    "quant_dequantize": (_quant, _run_dequant, DEQUANT, "rows"),
    "silu_invariant": (_pointwise, lambda a: library().silu_invariant(a["x"], a["out"]),
                       POINTWISE, "out"),
    "sigmoid_invariant": (_pointwise, lambda a: library().sigmoid_invariant(a["x"], a["out"]),
                          POINTWISE, "out"),
    "greedy_rows": (_greedy, lambda a: a["out"].copy_(library().greedy_rows(a["logits"])),
                    GREEDY, "out"),
    "greedy_rows_masked": (_bitmask, lambda a: a["out"].copy_(
        library().greedy_rows(a["logits"], a["allowed"])), BITMASK, "out"),
    "apply_token_bitmask_": (_bitmask, _apply_bitmask, BITMASK, "out"),
    "top_rows": (_top, lambda a: a["out"].copy_(
        library().top_rows(a["logits"], a["rows"], a["k"])[1]), TOP, "out"),
    "rms_norm": (_norm, lambda a: library().rms_norm(a["x"], a["w"], a["out"], 1e-6, True),
                 WEIGHTED, "out"),
    "gated_rms_norm": (_norm, lambda a: library().gated_rms_norm(a["x"], a["gate"], a["w"],
                                                                  a["out"], 1e-6), GATED, "out"),
    "l2_normalize": (_norm, lambda a: library().l2_normalize(a["x"], a["out"], 1e-6), NORM,
                     "out"),
}
CASES = [(op, case) for op, (_, _, cases, _) in OPS.items() for case in cases]


def _good(op: str) -> tuple[Args, torch.Tensor]:
    make, run, _, result = OPS[op]
    a = make()
    run(a)
    return a, a[result].clone()


@pytest.mark.parametrize(("op", "case"), CASES, ids=[f"{op}-{c[0]}" for op, c in CASES])
def test_bad_input_is_refused_by_name(op: str, case: Corruption) -> None:
    make, run, _, result = OPS[op]
    _, want = _good(op)
    name, mutate, message = case
    a = make()
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    mutate(a)
    written = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=rf"^pagedhybrid\.{op.removesuffix('_masked')}: {message}"):
        run(a)
    for k, v in a.items():  # refused before anything was written
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, written[k]), (name, k)
    # the process goes on: a good call after gives the same result
    good = make()
    for k, v in before.items():
        assert torch.equal(good[k], v)
    run(good)
    assert torch.equal(good[result], want), name


def test_padding_after_the_pages_a_sequence_reads_is_allowed() -> None:
    """-1 (or garbage) entries past ceil(total / bs) are never read, so never checked."""
    a = _attention()
    a["block_table"] = torch.tensor([[4, 1, -1, 99], [2, -7, 1 << 30, -1]], dtype=torch.int32)
    _run_attention(a)
    want, _ = _good("paged_attention")
    assert torch.equal(a["out"], want["out"])
    # a sequence not listed in seqs reads nothing: its row is not checked either
    b = _attention()
    b["block_table"] = torch.tensor([[4, 1], [-5, 77]], dtype=torch.int32)
    b["seqs"] = torch.tensor([0], dtype=torch.int32)
    _run_attention(b)
    assert torch.equal(b["out"][:1], want["out"][:1]) and not b["out"][1:].any()


def test_every_exported_op_is_covered() -> None:
    import re

    from pagedhybrid.kernels.native import CSRC

    defs = set()
    for path in CSRC.glob("*.cpp"):
        defs |= set(re.findall(r'm\.def\(\s*"(\w+)\(', path.read_text()))
    info = {"cpu_form", "bf16_dot", "int8_dot", "code_prefetch", "vector_lanes",
            "num_threads"}  # no arguments
    assert defs - info - {"set_num_threads"} == set(OPS) - {"greedy_rows_masked"}, defs


def test_the_pool_thread_count_is_clamped_and_reverts_to_torchs() -> None:
    lib = library()
    try:
        lib.set_num_threads(3)
        assert lib.num_threads() == 3
        lib.set_num_threads(-5)  # <= 0: torch's setting at each call
        assert lib.num_threads() == torch.get_num_threads()
        lib.set_num_threads(1 << 40)
        assert lib.num_threads() == 1024
    finally:
        lib.set_num_threads(0)
