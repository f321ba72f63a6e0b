"""Continuous-batching engine for hybrid decoders, by concept (vLLM v1's layout):

* ``core/`` -- requests (``request.py``), the scheduler (``scheduler.py``: token budget, chunked
  prefill, decode and prefill in one packed step, preemption by recompute), the KV pages
  (``pages.py``: ``BlockPool``, prefix caching) and state slots (``states.py``), the engine's
  configs (``config.py``), the memory plan (``memory.py``), stats, KV events, the output types
  (``outputs.py``) and the incremental detokenizer.
* ``sample/`` -- ``SamplingParams`` and the sampler (``sampler.py``), grammars for structured
  outputs (``structured.py``).
* ``spec_decode/`` -- speculative decoding: the ``Proposer`` interface and its registry
  (``proposer.py``), the n-gram and MTP proposers, the draft budget and verification.
* ``worker/`` -- ``ModelRunner`` (``runner.py``: prepare -> model -> sampler), the step's
  sampling (``sampling.py``), tensor-parallel ranks (``distributed.py``), the thread governor.
* ``engine.py`` -- ``Engine``: ``add_request`` / ``abort_request`` / ``step`` (schedule -> runner
  -> update) / ``stream``; ``loader.py`` -- ``load_engine`` (a checkpoint folder to an engine).

Sub-packages import downward only, in the order sample -> core -> spec_decode -> worker ->
``engine.py`` / ``loader.py`` (``tests/test_layering.py``). ``LLM`` (offline generation and
chat) is an entry point and lives in ``serve/llm.py``.
"""

from __future__ import annotations

from pagedhybrid.engine.core.config import EngineConfig
from pagedhybrid.engine.core.outputs import CompletionOutput, RequestOutput
from pagedhybrid.engine.core.pages import BlockPool
from pagedhybrid.engine.core.request import (
    FinishReason,
    InvalidRequest,
    Request,
    SequenceDelta,
    SequenceOutput,
)
from pagedhybrid.engine.core.scheduler import (
    HybridAllocator,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedhybrid.engine.core.states import StatePool
from pagedhybrid.engine.core.stats import EngineStats
from pagedhybrid.engine.engine import Engine
from pagedhybrid.engine.loader import load_engine
from pagedhybrid.engine.sample.sampler import GREEDY, Logprob, SampledToken, SamplingParams, sample
from pagedhybrid.engine.worker.input_batch import InputBatch, StepPlan
from pagedhybrid.engine.worker.runner import ModelRunner

__all__ = [
    "GREEDY",
    "BlockPool",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "HybridAllocator",
    "InputBatch",
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
    "SequenceDelta",
    "SequenceOutput",
    "StatePool",
    "StepPlan",
    "load_engine",
    "sample",
]
