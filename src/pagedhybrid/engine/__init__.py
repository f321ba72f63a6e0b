"""Continuous-batching engine for hybrid decoders: KV pages + state slots, scheduler, sampling.

* ``BlockPool`` (``pages.py``) -- KV pages of the full-attention layers: free list, reference
  counts, per-request block tables.
* ``StatePool`` (``states.py``) -- one fixed conv + recurrent state slot per running request.
* ``Scheduler`` (``scheduler.py``) -- token budget, ``max_num_seqs``, chunked prefill, decode and
  prefill in one packed step, FCFS admission into both pools atomically, preemption by recompute.
* ``SamplingParams`` / ``sample`` (``sampling.py``) -- greedy, temperature, top-k, top-p, seeds,
  stop ids / EOS, ``logprobs``.
* ``EngineConfig`` (``config.py``) -- pool sizes and batching limits.
* ``plan_memory`` / ``MemoryPlan`` (``memory.py``) -- the cache budget from the model and the
  machine (or the options), split into pages, slots and checkpoints; the start-up line.
* ``ThreadGovernor`` (``contention.py``) -- one thread while other processes keep the cores busy,
  the engine's threads again when they leave room (the runner ticks it before each step).
* ``ModelRunner`` (``runner.py``) -- owns the model, its kernel bundle and the cache; runs one
  scheduled step (prepare -> model -> sampler) and ``score`` (the training-side recompute).
* ``SpeculativeConfig`` / ``NgramDrafter`` / ``DraftBudget`` / ``verify`` (``speculative.py``) --
  speculative decoding: vLLM's config, n-gram drafts, the budget that keeps drafts only where
  they pay, verification by rejection sampling (the states rolled back by ``kernels/capsule.py``);
  ``MtpDrafter`` (``mtp.py``) -- drafts from the checkpoint's MTP head.
* ``IncrementalDetokenizer`` (``detokenizer.py``) -- each request's text, O(new tokens) a step;
  the server reads it.
* ``Engine`` (``engine.py``) -- ``add_request`` / ``abort_request`` / ``step`` (schedule ->
  runner -> update) / ``stream``; ``LLM`` (``llm.py``) -- offline ``generate`` and ``chat``.
"""

from __future__ import annotations

from pagedhybrid.engine.config import EngineConfig
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.llm import LLM, Throughput, load_engine
from pagedhybrid.engine.outputs import CompletionOutput, RequestOutput
from pagedhybrid.engine.pages import BlockPool
from pagedhybrid.engine.request import FinishReason, InvalidRequest, Request, SequenceOutput
from pagedhybrid.engine.runner import ModelRunner, build_batch
from pagedhybrid.engine.sampling import GREEDY, Logprob, SampledToken, SamplingParams, sample
from pagedhybrid.engine.scheduler import (
    HybridAllocator,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedhybrid.engine.states import StatePool
from pagedhybrid.engine.stats import EngineStats

__all__ = [
    "GREEDY",
    "LLM",
    "BlockPool",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "HybridAllocator",
    "InvalidRequest",
    "Logprob",
    "ModelRunner",
    "Request",
    "RequestOutput",
    "SampledToken",
    "SamplingParams",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceOutput",
    "StatePool",
    "Throughput",
    "build_batch",
    "load_engine",
    "sample",
]
