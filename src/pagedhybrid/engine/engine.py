"""The request-level engine: add / abort / step / stream over one Qwen3.5 model.

One ``step()`` is schedule -> run -> update:

1. ``Scheduler.schedule()`` picks this step's chunks (decodes and prefill chunks mixed) under
   the token budget, admitting into KV pages and state slots atomically, preempting by recompute
   when pages run out; its ``SchedulerOutput`` is the one contract with the runner.
2. ``ModelRunner.run`` (``runner.py``) builds the step's packed batch once, runs the model over
   the cache in place and samples: sampled tokens by request, and requests that failed (non-finite
   logits, a sampling error) -- those fail alone.
3. ``Scheduler.update`` advances cursors, appends tokens and finishes requests on stop token /
   EOS / max_tokens / max_model_len, returning their pages and slots at once (verify chunks'
   accepted states committed through ``ModelRunner.commit``); each reported request's text
   grows through its ``IncrementalDetokenizer``.
4. With speculative decoding (``EngineConfig.speculative_config``), the drafter (n-gram,
   ``spec_decode/ngram.py``, or the checkpoint's MTP head over the step's hidden states,
   ``spec_decode/mtp.py``: a registered ``Proposer``)
   proposes the next step's drafts for the decoding requests and ``DraftBudget`` keeps those
   that pay for their rows by the engine's own step times -- none while more than
   ``disable_by_batch_size`` requests are running. A drafter that raises costs that step its
   drafts only.

``step`` returns one ``SequenceOutput`` per request that got a token or finished (aborts are
reported by the next ``step``). A step that raises (a bug, never a request's input) does not
stop the engine: that step's requests finish with reason ``error``, the pools are checked (and
rebuilt if they do not add up) and the next step serves the others; a request that breaks
admission, bookkeeping or detokenisation fails alone. ``stats`` splits wall time into
scheduling, batch building, forward, sampling and bookkeeping.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures
from typing import TYPE_CHECKING

import torch

from pagedhybrid.engine.core.config import EngineConfig, slot_bytes
from pagedhybrid.engine.core.detokenizer import IncrementalDetokenizer
from pagedhybrid.engine.core.kv_events import open_publisher
from pagedhybrid.engine.core.memory import MemoryPlan, available_memory, plan_memory, weight_bytes
from pagedhybrid.engine.core.pages import BlockPool
from pagedhybrid.engine.core.request import InvalidRequest, Request, RequestStatus, SequenceOutput
from pagedhybrid.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedhybrid.engine.core.states import CheckpointPool, StatePool
from pagedhybrid.engine.core.stats import EngineStats
from pagedhybrid.engine.sample.sampler import SamplingParams, bad_words_token_ids
from pagedhybrid.engine.sample.structured import GrammarCompiler, matcher_token
from pagedhybrid.engine.spec_decode import (
    DraftBudget,
    Proposer,
    ProposerContext,
    draftable,
    proposer_spec,
)
from pagedhybrid.engine.worker.runner import ModelRunner, StepResult
from pagedhybrid.errors import ContractViolation, EngineDead
from pagedhybrid.kernels.backend import Selection
from pagedhybrid.models.qwen35 import PagedHybridCache, Qwen35ForCausalLM

if TYPE_CHECKING:
    from pagedhybrid.engine.worker.distributed import TensorParallelGroup

GRAMMAR_WAIT_S = 0.05  # a step with only compiling grammars to wait for waits this long at most


class Engine:
    """Continuous-batching engine over a loaded ``Qwen35ForCausalLM``."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig | None = None,
                 tokenizer: object | None = None, peers: TensorParallelGroup | None = None
                 ) -> None:
        self.config = config or EngineConfig()
        if self.config.tensor_parallel_size > 1 and (
                peers is None or peers.world_size != self.config.tensor_parallel_size):
            raise ContractViolation("EngineConfig", "tensor_parallel_size",
                                    "> 1 needs its other ranks: build the engine with "
                                    "load_engine / LLM, which start them",
                                    self.config.tensor_parallel_size)
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.eos_token_ids = tuple(model.config.eos_token_id) or tuple(
            getattr(tokenizer, "eos_token_ids", ()) or ())
        spec = self.config.speculative
        # the registered proposer speculative_config.method names (refused before any work)
        self.proposer = None if spec is None else proposer_spec(spec)
        # the kernels first: the weights are held as they multiply (packed or plain) before the
        # memory is measured and planned
        self.runner = ModelRunner(model, self.config, self.stats, self.eos_token_ids, peers)
        local = 1 if peers is None else peers.local_ranks  # ranks sharing this machine's memory
        self.memory: MemoryPlan = plan_memory(
            model.config, self.config, model.dtype, weight_bytes(model),
            available=None if local == 1 else available_memory() // local,
            unmapped=weight_bytes(model, mapped_only=True),
            draft_head=self.proposer is not None and self.proposer.model_head)
        for warning in self.memory.warnings:
            print(f"pagedhybrid: warning: {warning}", file=sys.stderr)
        self.sizes = self.memory.sizes
        self.runner.allocate(self.sizes)
        self.kv_events = open_publisher(self.config.kv_events_config)  # None: events off
        self._make_pools()
        self.draft_budget = DraftBudget()
        self.drafter: Proposer | None = None
        if spec is not None and self.proposer is not None:
            self.drafter = self.proposer.build(ProposerContext(
                spec, self.runner, lambda r: self.blocks.table(r.request_id),
                (lambda reqs, costs: self.draft_budget.trim(reqs, len(self.scheduler.running),
                                                             costs))
                if spec.adaptive and self.proposer.budgets_itself else None))
        self.grammars: GrammarCompiler | None = None  # structured outputs (when first asked)
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._arrivals = 0
        self._pending: list[SequenceOutput] = []

    @property
    def model(self) -> Qwen35ForCausalLM:
        return self.runner.model

    @property
    def dead(self) -> str | None:
        """Why this engine can serve no more (a tensor-parallel rank went away); None while it
        serves."""
        peers = self.runner.peers
        return None if peers is None else peers.dead

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (the engine is dead after) and the KV-events
        publisher."""
        if self.runner.peers is not None:
            self.runner.peers.close()
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def cache(self) -> PagedHybridCache:
        return self.runner.cache

    @property
    def kernels(self) -> Selection:
        return self.runner.kernels

    def _make_pools(self) -> None:
        """Fresh page, slot and checkpoint pools and a scheduler over them."""
        sizes, caching = self.sizes, self.config.enable_prefix_caching
        self.blocks = BlockPool(sizes.num_blocks, self.config.block_size, caching=caching,
                                record_events=self.kv_events is not None)
        self.states = StatePool(sizes.num_slots)
        self.checkpoints = CheckpointPool(sizes.num_checkpoints) if caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                            sizes.max_model_len, self._lookahead()),
            self.blocks, self.states, self.eos_token_ids, self.checkpoints,
            self.config.checkpoint_interval, self.config.prefix_cache_key)

    def _lookahead(self) -> int:
        """Page positions reserved past a sampling chunk: the proposer's chain's (MTP's)."""
        spec = self.config.speculative
        return 0 if spec is None or self.proposer is None else self.proposer.lookahead(
            spec.num_speculative_tokens)

    def score(self, prompts: Sequence[str | Sequence[int]],
              completions: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """Each completion token's fp32 log-probability after its prompt, from one full forward
        per sequence (``ModelRunner.score``): the training-side recompute. A text pair is
        encoded as lm-eval encodes a loglikelihood request (``_continuation``); a text
        completion after token ids is encoded without special tokens."""
        op = "LLM.score"
        if isinstance(prompts, str) or isinstance(completions, str):
            raise InvalidRequest(op, "prompts/completions", "must be lists (one entry per pair)")
        if len(prompts) != len(completions):
            raise InvalidRequest(op, "completions", "must have one entry per prompt",
                                 (len(prompts), len(completions)))

        def ids(what: str, i: int, x: str | Sequence[int], special: bool | None = None
                ) -> list[int]:
            try:
                return self._token_ids(f"{what}[{i}]", x, special)
            except InvalidRequest as exc:
                raise InvalidRequest(op, f"{what}[{i}]", exc.rule, exc.got) from None

        pairs = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            if isinstance(p, str) and isinstance(c, str) and c:  # lm-eval's pair
                p, c = self._continuation(p, c)
            pairs.append((ids("prompts", i, p), ids("completions", i, c, special=False)))
        limit = self.model.config.max_position_embeddings
        for i, (p, c) in enumerate(pairs):
            if len(p) + len(c) > limit:
                raise InvalidRequest(op, f"prompts[{i}]", f"prompt + completion must fit "
                                     f"max_position_embeddings = {limit}", len(p) + len(c))
        return self.runner.score(pairs)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a request. ``prompt``: text (tokenised with the model's tokenizer) or token ids.

        Raises ``InvalidRequest`` (empty prompt, bad token ids, ids or ``top_k`` outside the
        vocabulary, duplicate id, text or bad words without a tokenizer) or ``CapacityError``
        (the prompt can never fit); nothing is queued then.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(str(request_id), "request_id", "must be a non-empty str",
                                 type(request_id).__name__)
        if self.dead is not None:
            raise EngineDead(self.dead)
        if request_id in self.scheduler.requests:
            raise InvalidRequest(request_id, "request_id", "is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(request_id, "params", "must be SamplingParams",
                                 type(params).__name__)
        if params.num_sequences > 1:
            raise InvalidRequest(request_id, "n" if params.best_of is None else "best_of",
                                 "must be 1 here: an engine request is one sequence "
                                 "(LLM.generate and the server run SamplingParams.sequences())",
                                 params.num_sequences)
        if params.stop and self.tokenizer is None:
            raise InvalidRequest(request_id, "stop", "stop strings need the model's tokenizer")
        ids = self._token_ids(request_id, prompt)
        try:
            params.check_vocab(self.model.config.vocab_size)
        except ContractViolation as exc:
            raise InvalidRequest(request_id, exc.where, exc.rule, exc.got) from None
        bad_words: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequest(request_id, "bad_words", "needs the model's tokenizer")
            enc = self.tokenizer.encode  # type: ignore[attr-defined]
            bad_words = bad_words_token_ids(params.bad_words,
                                            lambda t: list(enc(t, add_special_tokens=False)))
        gen = (torch.Generator().manual_seed(params.seed) if params.seed is not None
               else self._generator)
        req = Request(request_id, tuple(ids), params, self._arrivals, gen,
                      bad_word_ids=bad_words)
        if params.structured_outputs is not None:  # compiled off the step (GrammarCompiler)
            req.grammar = self._compiler(request_id).submit(params.structured_outputs)
        if self.tokenizer is not None and params.detokenize:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.scheduler.add(req)  # CapacityError when it can never fit
        self._arrivals += 1

    def _compiler(self, request_id: str) -> GrammarCompiler:
        """The grammar thread, started by the first constrained request."""
        if self.tokenizer is None:
            raise InvalidRequest(request_id, "structured_outputs", "needs the model's tokenizer")
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                            self.eos_token_ids)
        return self.grammars

    def _collect_grammars(self) -> bool:
        """Matchers that finished compiling go to their requests (a grammar that failed to
        compile fails its request alone); True while some are still compiling."""
        pending = False
        for req in [r for r in self.scheduler.waiting if r.grammar is not None]:
            if not req.grammar.done():
                pending = True
                continue
            try:
                req.matcher = req.grammar.result()
            except Exception as exc:
                why = exc.rule if isinstance(exc, ContractViolation) else \
                    f"did not compile: {type(exc).__name__}: {exc}"
                self.scheduler.finish(req, "error", f"structured_outputs {why}")
                self.scheduler.failed.append(req)
            req.grammar = None
        return pending

    def _continuation(self, context: str, completion: str
                      ) -> tuple[str | list[int], str | list[int]]:
        """lm-eval's loglikelihood pair of texts: the context's trailing whitespace moves to
        the completion, and the completion's tokens are those that ``context + completion``
        has past ``context`` (both encoded without special tokens) -- what the model reads
        when the whole text is its input. The context is then encoded as a prompt is (special
        tokens as ``add_request`` encodes it). An empty context is left to be refused."""
        n = len(context) - len(context.rstrip())
        if n and context[:-n]:
            context, completion = context[:-n], context[-n:] + completion
        if not context or self.tokenizer is None:
            return context, completion  # type: ignore[return-value]
        enc = self.tokenizer.encode  # type: ignore[attr-defined]
        whole = list(enc(context + completion, add_special_tokens=False))
        return list(enc(context)), whole[len(enc(context, add_special_tokens=False)):]

    def _token_ids(self, request_id: str, prompt: str | Sequence[int],
                   special: bool | None = None) -> list[int]:
        """Token ids of a prompt; text is encoded with the tokenizer's special tokens as it
        adds them by default (``special`` None), or with / without them."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(request_id, "prompt", "is text but the model has no "
                                     "tokenizer; pass token ids")
            enc = self.tokenizer.encode  # type: ignore[attr-defined]
            ids = list(enc(prompt) if special is None else enc(prompt, add_special_tokens=special))
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.reshape(-1).tolist()
            try:
                ids = list(prompt)
            except TypeError:
                raise InvalidRequest(request_id, "prompt", "must be text or a sequence of "
                                     "token ids", type(prompt).__name__) from None
        if not ids:
            raise InvalidRequest(request_id, "prompt", "is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(request_id, "prompt_token_ids",
                                 f"must be ints in [0, {vocab})", bad[:5])
        return ids

    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        """Abort requests now (pages and slots freed at once); returns the ids found."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        done = []
        for rid in ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                self._pending.append(self._output(req))
                done.append(rid)
        return done

    def fail_requests(self, requests: Iterable[Request], why: str) -> list[SequenceOutput]:
        """Finish ``requests`` now with reason ``error`` and message ``why``."""
        outputs = []
        for req in requests:
            if not req.finished:
                self.scheduler.finish(req, "error", why)
                outputs.append(self._output(req))
        return outputs

    def reset_stats(self) -> None:
        """Counters from zero (a benchmark after its warm-up); the runner adds to the same."""
        self.stats = self.runner.stats = EngineStats()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        """schedule -> runner -> update (see the module docstring)."""
        outputs, self._pending = self._pending, []
        sched: SchedulerOutput | None = None
        st = self.stats
        if self.dead is not None:  # nothing can run: every request fails with the reason
            return outputs + self.fail_requests(list(self.scheduler.requests.values()),
                                                self.dead)
        try:
            compiling = self.grammars is not None and self._collect_grammars()
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            t_sched = time.perf_counter() - t0
            st.schedule_s += t_sched
            st.preemptions += len(sched.preempted)
            if sched.sequences:
                result = self.runner.run(sched)
                t1 = time.perf_counter()
                for req, why in result.failed:
                    self.scheduler.finish(req, "error", why)
                    if self.checkpoints is not None:  # never keep a failed computation's states
                        seq = next(s for s in sched.sequences if s.request is req)
                        self.checkpoints.discard(row for _, row in seq.checkpoints)
                self.scheduler.update(sched, result.sampled, self.runner.commit)
                t_draft = time.perf_counter()
                self._draft()
                t_draft = time.perf_counter() - t_draft
                outputs.extend(self._output(s.request) for s in sched.sequences
                               if s.request.finished
                               or s.request.num_output_tokens > s.request.num_emitted)
                self._account(sched, result, t0, t_sched, t1, t_draft)
            elif compiling:  # only grammars to wait for: wait for one, not in a busy loop
                futures.wait([r.grammar for r in self.scheduler.waiting
                              if r.grammar is not None], GRAMMAR_WAIT_S,
                             futures.FIRST_COMPLETED)
        except Exception as exc:  # the engine must outlive a faulty step
            outputs.extend(self._fail_step(sched, exc))
        outputs.extend(self._output(r) for r in self.scheduler.take_failed())
        if self.kv_events is not None:  # this step's page-index changes, one batch
            self.kv_events.publish(self.blocks.take_events())
        return outputs

    def _draft(self) -> None:
        """The next step's drafts (speculative decoding): for each decoding request that may
        be drafted for, none for the others or while the batch is larger than
        ``disable_by_batch_size``."""
        spec = self.config.speculative
        if self.drafter is None or spec is None:
            return
        running = self.scheduler.running
        on = spec.disable_by_batch_size is None or len(running) <= spec.disable_by_batch_size
        todo = []
        for req in running:
            req.draft_ids = ()
            if on and req.num_tokens - req.num_computed_tokens == 1 and draftable(req):
                todo.append(req)
        try:
            self.drafter.propose(todo, spec.num_speculative_tokens)  # (MTP: catch-up always)
        except Exception as exc:  # drafts are optional: the requests decode without them
            print(f"pagedhybrid: drafter failed, no drafts this step: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr)
            self.stats.spec.drafter_failures += 1
            for req in todo:
                req.draft_ids = ()
        for req in todo:  # a grammar's requests: drafts up to the first one it would refuse
            if req.matcher is not None and req.draft_ids:
                req.draft_ids = tuple(req.draft_ids[:req.matcher.validate_tokens(
                    [matcher_token(t, self.eos_token_ids) for t in req.draft_ids])])
        if todo and spec.adaptive and not (self.proposer and self.proposer.budgets_itself):
            self.draft_budget.trim([r for r in todo if r.draft_ids], len(running))

    def _account(self, sched: SchedulerOutput, result: StepResult, t0: float, t_sched: float,
                 t1: float, t_draft: float) -> None:
        st = self.stats
        t2 = time.perf_counter()
        st.steps += 1
        st.prompt_tokens += sum(s.request.num_prompt_tokens for s in sched.sequences
                                if s.request.finished)
        st.computed_tokens += sched.num_batched_tokens
        st.generated_tokens += sum(len(t) for t in result.sampled.values())
        st.peak_running = max(st.peak_running, len(sched.sequences))
        st.peak_blocks = max(st.peak_blocks, self.blocks.num_owned)
        st.update_s += t2 - t1
        st.step_log.append((len(sched.sequences), sched.num_batched_tokens,
                            t_sched + result.prepare_s, t2 - t0))
        if all(s.num_new_tokens == 1 or s.drafts for s in sched.sequences):  # decodes, verifies
            # the step without the drafter's time: the budget counts that per draft position
            self.draft_budget.observe(sched.num_batched_tokens, t2 - t0 - t_draft,
                                      any(s.drafts for s in sched.sequences))
        for s in sched.sequences:  # the verdicts on this step's drafts: newcomers' prior
            kept = result.sampled.get(s.request.request_id)
            if s.drafts and kept:
                self.draft_budget.judge(len(kept) - 1, len(kept) - 1 < len(s.drafts))

    def _fail_step(self, sched: SchedulerOutput | None, exc: Exception) -> list[SequenceOutput]:
        """A step raised: fail its requests (all running ones when scheduling itself raised),
        drop the step's checkpoint writes, check the pools; rebuild them if they do not add up
        (every request then fails: nothing else can be trusted)."""
        if self.dead is not None:  # a tensor-parallel rank is gone: so is every request
            return self.fail_requests(list(self.scheduler.requests.values()), self.dead)
        why = f"internal error in an engine step: {type(exc).__name__}: {exc}"
        print(f"pagedhybrid: {why}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        self.stats.step_failures += 1
        victims = ([s.request for s in sched.sequences] if sched is not None
                   else list(self.scheduler.running))
        if self.checkpoints is not None:
            self.checkpoints.abandon()
        outputs = self.fail_requests(victims, why)
        try:
            self.check_invariants()
        except Exception as broken:
            print(f"pagedhybrid: pools inconsistent after the failed step ({broken}); "
                  "failing every request and rebuilding them", file=sys.stderr)
            for req in list(self.scheduler.requests.values()):
                req.status, req.finish_reason, req.error = (RequestStatus.FINISHED, "error",
                                                            why)
                outputs.append(self._output(req))
            self._make_pools()
            self.stats.pool_rebuilds += 1
        return outputs

    def stream(self) -> Iterator[SequenceOutput]:
        """Step until every request is finished, yielding outputs as they come (requests may be
        added or aborted between yields)."""
        while self.has_unfinished_requests():
            yield from self.step()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def prefix_cache_stats(self) -> dict[str, float | int]:
        """Prefix-cache counters: lookups, hits, tokens looked up / served, evictions, and the
        memory of the checkpoint pool (all zero when prefix caching is off)."""
        st = self.scheduler.alloc.stats
        ck = self.checkpoints
        return {
            "queries": st.queries, "hits": st.hits, "query_tokens": st.query_tokens,
            "hit_tokens": st.hit_tokens,
            "hit_rate": st.hits / st.queries if st.queries else 0.0,
            "cached_token_fraction": st.hit_tokens / st.query_tokens if st.query_tokens else 0.0,
            "page_evictions": self.blocks.evictions, "cached_pages": self.blocks.num_cached,
            "checkpoints_written": st.checkpoints_written,
            "checkpoint_evictions": ck.evictions if ck is not None else 0,
            "cached_checkpoints": ck.num_cached if ck is not None else 0,
            "checkpoint_bytes": (ck.capacity if ck is not None else 0) * slot_bytes(
                self.model.config, self.model.dtype),
        }

    # -- outputs ---------------------------------------------------------------------------------
    def _output(self, req: Request) -> SequenceOutput:
        n = req.num_output_tokens
        new = req.token_ids[req.num_prompt_tokens + req.num_emitted:]
        req.num_emitted = n
        text = new_text = None
        detok = req.detokenizer
        if detok is not None:
            try:
                text = self._text(req, detok, new)
                new_text, req.text_emitted = text[req.text_emitted:], len(text)
            except Exception as exc:  # this request fails alone
                why = f"detokenisation failed: {type(exc).__name__}: {exc}"
                if not req.finished:
                    self.scheduler.finish(req, "error", why)
                else:
                    req.finish_reason, req.error = "error", why
                req.detokenizer = None
        plp = (req.prompt_logprobs if req.params.prompt_logprobs is not None
               and req.prompt_logprobs_done else None)
        plp_new = plp is not None and not req.prompt_logprobs_emitted
        req.prompt_logprobs_emitted |= plp_new
        req.num_reports += 1
        return SequenceOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=tuple(new),
            finished=req.finished,
            finish_reason=req.finish_reason,
            text=text,
            num_generated=n,
            sequence=req.token_ids,
            generated_logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprob_list=plp,
            error=req.error,
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason,
            new_text=new_text,
            first=req.num_reports == 1,
            prompt_logprobs_new=plp_new,
        )

    def _text(self, req: Request, detok: IncrementalDetokenizer, new: Sequence[int]) -> str:
        """The output's text after ``new`` (vLLM's rules): the stop token or EOS that ended it
        is not in the text unless ``include_stop_str_in_output``; a stop string found in the
        text finishes the request (``stop_reason``; the text ends before it, or after it with
        ``include_stop_str_in_output``); while it runs, the last ``len(longest stop) - 1``
        characters, which may begin one, are held back (so the text only ever grows)."""
        p = req.params
        if (req.finish_reason == "stop" and new and not p.include_stop_str_in_output
                and (new[-1] == req.stop_reason or new[-1] in self.eos_token_ids)):
            new = new[:-1]
        checked = len(detok.text)
        detok.add(new)
        if req.finished:
            detok.finish()
        hit = req.match_stop(detok.text, checked) if p.stop else None
        if hit is not None:
            req.stop_reason, end = hit
            detok.text = detok.text[:end]
            if req.finished:
                req.finish_reason = "stop"
            else:
                self.scheduler.finish(req, "stop")
        elif p.stop and not req.finished:
            return detok.text[:max(0, len(detok.text) - max(map(len, p.stop)) + 1)]
        return detok.text
