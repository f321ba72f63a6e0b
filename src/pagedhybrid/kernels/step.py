"""One packed step's metadata, built and validated once, read by every layer's kernels.

A step packs the new tokens of ``B`` sequences back to back (``N`` tokens). ``StepMetadata``
holds what the kernels of every layer need, on the host (python tuples, for loops and shapes)
and as tensors (for the kernels), so no layer converts tensors to lists or re-validates:

* per sequence: new tokens ``q_lens``, cached tokens ``past_lens``, ``total_lens``, the row
  offsets ``cu_seqlens`` (also int32 ``[B+1]``), the ``block_table`` (int32 ``[B, M]``), the
  state-pool row ``state_slots`` (int64 ``[B]``) and the ``fresh`` mask (past 0: the sequence
  starts from zero conv/recurrent state whatever its pool row holds -- bool ``[B]``);
* per token: its absolute ``positions`` and the flat cache slot it writes, ``write_slots``
  (``page * block_size + offset``, int64 ``[N]``);
* the decode split: ``decode`` (sequences with one new token) and ``multi`` (more than one);
* state checkpoints to emit (prefix caching): ``checkpoints`` -- (sequence, offset, row): the
  conv and recurrent state after the sequence's first ``offset`` new tokens of this step goes
  into row ``row`` of the layer's checkpoint pools (``offset`` = its new-token count: the state
  at the end of the chunk).
* speculative verify sequences: ``verify`` -- sequences (each with at least two new tokens: its
  last sampled token and its drafts, never fresh, no checkpoints) whose state rows the step
  leaves unchanged, capturing their compact state updates instead (``kernels/capsule.py``).

``layer_spec.LayerWeights`` is what a bundle's ``gdn_decode_layer`` / ``attention_decode_layer``
read of one decoder layer (the model gathers it as ``kernels/layer_spec.py`` declares; the
kernels never see a module).

``StepMetadata.build`` checks everything a kernel could trip over -- lengths, that every page a
sequence touches is mapped and inside the pool, that state slots are in range and distinct --
and raises ``ContractViolation`` naming the field; kernels only assert. ``memo(key, fn)`` keeps
a derived per-step plan (e.g. attention tiles) so it is also computed once per step.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pagedhybrid.errors import ContractViolation

OP = "pagedhybrid.StepMetadata"
_TYPECODES = {torch.int32: "i", torch.int64: "q", torch.bool: "b"}


def int_tensor(values: Iterable[int], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D ``dtype`` (int32, int64 or bool) tensor of python ints, through a typed buffer:
    ~2 us where ``torch.tensor`` of a short list takes ~5 (a step builds several)."""
    buf = array.array(_TYPECODES[dtype], values)
    t = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
    return t if device == "cpu" or torch.device(device).type == "cpu" else t.to(device)


@dataclass(frozen=True)
class StepMetadata:
    q_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    block_size: int
    num_pages: int
    cu_seqlens_t: torch.Tensor  # int32 [B+1]
    past_t: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, M]
    state_slots: torch.Tensor  # int64 [B]
    fresh_t: torch.Tensor  # bool [B]
    positions: torch.Tensor  # int64 [N]
    write_slots: torch.Tensor | None  # int64 [N]; None without pages (the dense path)
    cu_seqlens: tuple[int, ...]
    decode: tuple[int, ...]  # sequences with exactly one new token
    multi: tuple[int, ...]  # sequences with more than one new token
    checkpoints: tuple[tuple[int, int, int], ...] = ()  # (sequence, offset, checkpoint row)
    verify: tuple[int, ...] = ()  # speculative verify sequences (state captured, not committed)
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def total_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.past_lens, self.q_lens, strict=True))

    @property
    def fresh(self) -> tuple[bool, ...]:
        return tuple(p == 0 for p in self.past_lens)

    @property
    def all_decode(self) -> bool:
        return len(self.decode) == self.batch

    @property
    def unverified(self) -> tuple[int, ...]:
        """The sequences that are not verify sequences."""
        return self.memo("unverified", lambda: tuple(
            b for b in range(self.batch) if b not in set(self.verify)))

    @property
    def decode_or_verify(self) -> bool:
        """Every sequence decodes one token or verifies drafts (the fused layers' steps)."""
        return len(self.decode) + len(self.verify) == self.batch

    @property
    def verify_mask(self) -> torch.Tensor:
        """bool ``[B]``: the verify sequences."""
        return self.memo("verify_mask", lambda: int_tensor(
            (b in set(self.verify) for b in range(self.batch)), torch.bool))

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` computed once per step (per ``key``)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def subset(self, seqs: tuple[int, ...]) -> tuple[torch.Tensor, StepMetadata]:
        """Token rows ``[n]`` of sequences ``seqs`` and the metadata of just those sequences
        (memoised: computed once per step)."""

        def make() -> tuple[torch.Tensor, StepMetadata]:
            idx = torch.tensor(seqs, dtype=torch.int64)
            rows = torch.cat([torch.arange(self.cu_seqlens[b], self.cu_seqlens[b + 1])
                              for b in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
            q = tuple(self.q_lens[b] for b in seqs)
            cu = [0]
            for n in q:
                cu.append(cu[-1] + n)
            sub = StepMetadata(
                q_lens=q, past_lens=tuple(self.past_lens[b] for b in seqs),
                block_size=self.block_size, num_pages=self.num_pages,
                cu_seqlens_t=torch.tensor(cu, dtype=torch.int32),
                past_t=self.past_t[idx], block_table=self.block_table[idx].contiguous(),
                state_slots=self.state_slots[idx], fresh_t=self.fresh_t[idx],
                positions=self.positions[rows],
                write_slots=None if self.write_slots is None else self.write_slots[rows],
                cu_seqlens=tuple(cu), decode=tuple(i for i, n in enumerate(q) if n == 1),
                multi=tuple(i for i, n in enumerate(q) if n > 1),
                checkpoints=tuple((seqs.index(s), o, r) for s, o, r in self.checkpoints
                                  if s in seqs),
                verify=tuple(seqs.index(s) for s in self.verify if s in seqs))
            return rows, sub

        return self.memo(f"subset{seqs}", make)

    def seq_index(self, seqs: tuple[int, ...]) -> torch.Tensor:
        """int32 ``[n]`` tensor of sequence indices (memoised)."""
        return self.memo(f"seqidx{seqs}", lambda: int_tensor(seqs, torch.int32))

    @classmethod
    def build(cls, q_lens: Sequence[int], past_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]] | torch.Tensor | None,
              state_slots: Sequence[int], *, block_size: int, num_pages: int, num_slots: int,
              device: torch.device | str = "cpu",
              checkpoints: Sequence[tuple[int, int, int]] = (), num_checkpoints: int = 0,
              verify: Sequence[int] = ()) -> StepMetadata:
        """Validated metadata of a step (``block_tables``: lists, an int32 ``[B, M]``, or None
        for a step without KV pages)."""

        def check(cond: bool, where: str, rule: str, got: object = None) -> None:
            if not cond:
                raise ContractViolation(OP, where, rule, got)

        q_lens, past_lens = tuple(int(x) for x in q_lens), tuple(int(x) for x in past_lens)
        slots = tuple(int(x) for x in state_slots)
        b = len(q_lens)
        check(b >= 1, "q_lens", "must hold at least one sequence", b)
        check(len(past_lens) == b and len(slots) == b, "past_lens/state_slots",
              f"need one entry per sequence ({b})", (len(past_lens), len(slots)))
        check(all(q >= 0 for q in q_lens) and all(p >= 0 for p in past_lens), "q_lens/past_lens",
              "must be >= 0", (q_lens, past_lens))
        check(block_size >= 1 and block_size & (block_size - 1) == 0, "block_size",
              "must be a power of two", block_size)
        if block_tables is None:
            rows, table = [[] for _ in range(b)], torch.zeros(b, 0, dtype=torch.int32)
        elif isinstance(block_tables, torch.Tensor):
            table = block_tables.to(torch.int32).contiguous()
            rows = table.tolist()
        else:
            width = max([len(r) for r in block_tables] + [1])
            rows = [list(r) + [-1] * (width - len(r)) for r in block_tables]
            table = int_tensor((x for r in rows for x in r), torch.int32).view(b, width)
        check(table.dim() == 2 and table.shape[0] == b, "block_table", f"must be [{b}, M]",
              tuple(table.shape))
        for i, (p, q) in enumerate(zip(past_lens, q_lens, strict=True)):
            if block_tables is None:
                break
            need = -(-(p + q) // block_size)
            used = rows[i][:need]
            check(len(used) == need, "block_table",
                  f"row {i} must map the {need} pages of its {p + q} tokens", len(used))
            check(all(0 <= x < num_pages for x in used), "block_table",
                  f"row {i} must name pages in [0, {num_pages})", used)
        check(all(0 <= s < num_slots for s in slots), "state_slots",
              f"must be in [0, {num_slots})", slots)
        check(len(set(slots)) == b, "state_slots", "must not repeat (one slot per sequence)",
              slots)
        ck = tuple((int(s), int(o), int(r)) for s, o, r in checkpoints)
        check(all(0 <= s < b and 1 <= o <= q_lens[s] and 0 <= r < num_checkpoints
                  for s, o, r in ck), "checkpoints",
              f"must be (sequence, 1 <= offset <= its new tokens, row < {num_checkpoints})", ck)
        check(len({r for _, _, r in ck}) == len(ck), "checkpoints", "rows must not repeat", ck)
        ver = tuple(int(s) for s in verify)
        check(len(set(ver)) == len(ver) and all(
            0 <= s < b and q_lens[s] >= 2 and past_lens[s] > 0 for s in ver), "verify",
            "must name distinct sequences, each with past tokens and >= 2 new tokens", ver)
        check(not any(s in ver for s, _, _ in ck), "verify",
              "sequences take no checkpoints during the step (their commit does)", ver)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        # per token, in python ints (a decode step's few values cost less than tensor ops)
        pos = [t for p, q in zip(past_lens, q_lens, strict=True) for t in range(p, p + q)]
        positions = int_tensor(pos, torch.int64, device)  # [N]
        write = None
        if block_tables is not None:
            write = int_tensor((rows[i][t // block_size] * block_size + t % block_size
                                for i, (p, q) in enumerate(zip(past_lens, q_lens, strict=True))
                                for t in range(p, p + q)), torch.int64, device)
        return cls(
            q_lens=q_lens, past_lens=past_lens, block_size=block_size, num_pages=num_pages,
            cu_seqlens_t=int_tensor(cu, torch.int32, device),
            past_t=int_tensor(past_lens, torch.int32, device), block_table=table.to(device),
            state_slots=int_tensor(slots, torch.int64, device),
            fresh_t=int_tensor((p == 0 for p in past_lens), torch.bool, device),
            positions=positions, write_slots=write, cu_seqlens=tuple(cu),
            decode=tuple(i for i, q in enumerate(q_lens) if q == 1),
            multi=tuple(i for i, q in enumerate(q_lens) if q > 1), checkpoints=ck, verify=ver)

    def advance(self, write_slots: Sequence[int], inputs: DecodeInputs | None = None
                ) -> StepMetadata | None:
        """The metadata of the next step of this decode-only step's sequences, each one token
        further on the same state slots and pages, writing flat cache slots ``write_slots`` (one
        per sequence, the slot after the one it wrote last); made from this step's tensors and
        the new values instead of lists, validated only where it differs. None when that is not
        this step's successor as a whole: a sequence that is not decoding, a checkpoint, or a
        token that starts a new page (its table row may have grown: ``build`` anew). With
        ``inputs`` (CPU) the new tensors are its views, written in place."""
        bs = self.block_size
        if not self.all_decode or self.checkpoints or self.write_slots is None or any(
                (p + 1) % bs == 0 for p in self.past_lens):
            return None
        if len(write_slots) != self.batch or not all(
                0 <= w < self.num_pages * bs for w in write_slots):
            raise ContractViolation(OP, "write_slots", f"need one per sequence ({self.batch}), "
                                    f"each in [0, {self.num_pages * bs})", tuple(write_slots))
        past = tuple(p + 1 for p in self.past_lens)
        device = self.positions.device
        if inputs is not None and self.batch <= inputs.capacity:
            past_t, positions, write = inputs.write(past, write_slots)
        else:  # one int_tensor path for all: after a forward has streamed the weights through
            # the caches, each further kind of torch op costs ~10 us of cold code
            past_t, positions = (int_tensor(past, torch.int32, device),
                                 int_tensor(past, torch.int64, device))
            write = int_tensor(write_slots, torch.int64, device)
        return StepMetadata(
            q_lens=self.q_lens, past_lens=past, block_size=bs, num_pages=self.num_pages,
            cu_seqlens_t=self.cu_seqlens_t, past_t=past_t,
            block_table=self.block_table, state_slots=self.state_slots,
            fresh_t=(int_tensor([False] * self.batch, torch.bool, device)
                     if 0 in self.past_lens else self.fresh_t),
            positions=positions, write_slots=write,
            cu_seqlens=self.cu_seqlens, decode=self.decode, multi=self.multi)

    @classmethod
    def dense(cls, batch: int, seq_len: int, past: int) -> StepMetadata:
        """``batch`` rows of ``seq_len`` new tokens after ``past`` cached ones (the dense path;
        state row b is sequence b, no pages)."""
        return cls.build([seq_len] * batch, [past] * batch, None, range(batch), block_size=1,
                         num_pages=0, num_slots=batch)


class DecodeInputs:
    """Host tensors that each decode step advanced from the last one reuses (vLLM's persistent
    input batch): for ``B`` sequences, int32 past lengths ``[B]`` and attention metadata
    ``[3]``, int64 positions, write slots and token ids ``[B]`` -- views of fixed CPU buffers
    whose numpy arrays are written in place, so advancing a step writes ints and makes no
    tensor. A step's tensors hold until the next step is written."""

    def __init__(self, max_batch: int) -> None:
        self._i64 = torch.zeros(3, max_batch, dtype=torch.int64)  # positions, writes, token ids
        self._i32 = torch.zeros(max_batch + 3, dtype=torch.int32)  # past lengths, metadata
        self._n64, self._n32 = self._i64.numpy(), self._i32.numpy()
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.capacity = max_batch  # sequences a step may have to use the buffers

    def _of(self, b: int) -> tuple[torch.Tensor, ...]:
        v = self._views.get(b)
        if v is None:
            v = self._views[b] = (self._i32[:b], self._i64[0, :b], self._i64[1, :b],
                                  self._i64[2, :b], self._i32[b:b + 3],
                                  self._i64[0:1, :b].expand(3, -1))
        return v

    def write(self, past: Sequence[int], write_slots: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 past lengths, int64 positions (= the past lengths) and int64 write slots."""
        b = len(past)
        self._n32[:b] = past
        self._n64[0, :b] = past
        self._n64[1, :b] = write_slots
        past_t, positions, write = self._of(b)[:3]
        return past_t, positions, write

    def tokens(self, ids: Sequence[int], max_query: int, max_kv: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 token ids ``[B]``, the int32 attention metadata ``[max_query, max_kv,
        max_kv]`` and the int64 ``position_ids [3, B]`` (the positions written last, as a
        view)."""
        b = len(ids)
        self._n64[2, :b] = ids
        self._n32[b:b + 3] = (max_query, max_kv, max_kv)
        ids_t, meta_t, position_ids = self._of(b)[3:]
        return ids_t, meta_t, position_ids


class MtpHeadInput(NamedTuple):
    """What a bundle's ``mtp.head_input`` / ``mtp.chain`` read of the MTP head before its layer
    (model dtype, the modules' parameters): the embedding table, the two offset norms' weights
    and ``eps``, and ``fc`` (or, with ``fc_quant``, its int8 / int4 form)."""

    embed: torch.Tensor
    norm_embedding: torch.Tensor
    norm_hidden: torch.Tensor
    eps: float
    fc: torch.Tensor
    fc_quant: Any = None  # weightquant.QuantizedWeight (this module imports nothing above it)


def quant_tensors(projections: Sequence[Any]) -> tuple[tuple[torch.Tensor, ...], int]:
    """The fused decode layers' view of a layer's int8 / int4 projections (each a
    ``weightquant.QuantizedWeight``, in the layer's order): (codes, scales, zeros -- an empty
    uint8 tensor when symmetric -- per projection, the bits). A layer's fields then hold each
    projection's codes in its weight's place."""
    out: list[torch.Tensor] = []
    for q in projections:
        out += [q.codes, q.scales, q.zeros if q.zeros is not None
                else torch.empty(0, dtype=torch.uint8)]
    return tuple(out), projections[0].fmt.bits
