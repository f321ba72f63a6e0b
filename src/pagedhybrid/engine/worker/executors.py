"""The executors a runner runs a step's forward with, chosen by capability once per step.

* ``EagerExecutor`` -- the model's modules (``Qwen35ForCausalLM.forward_packed``): any bundle,
  any step, any rank.
* ``LayersExecutor`` -- each decoder layer that has one as one fused native call (the others
  their modules), for a step of decodes and verify chunks.
* ``GraphExecutor`` -- the whole step in one native call (``Qwen35ForCausalLM.decode_graph``:
  the embedding, every layer, the final norm and the LM head, ``kernels/native/seam.py``
  ``DecodeStack``), bit for bit the eager path; bound at allocation where the bundle declares a
  whole step and the model and cache fit it (else never offered, with the reason).

``Executors.choose(meta, num_logits)`` asks the graph executor, then the layers executor, where
they bound, whether they take the step (``why_not``: a typed answer -- not a decode-only step,
prefill chunks, a product form not fused at the step's rows -- on the step's metadata alone),
else runs the eager one: no pointer checks and no fall-through inside the model. ``steps``
counts the steps each ran; ``describe`` is the kernel line's part.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, Qwen35ForCausalLM
from pagedhybrid.models.qwen35.decoder import PARAMETER_EPOCH


class Executor(Protocol):
    name: str

    def why_not(self, meta: StepMetadata, num_logits: int) -> str | None: ...

    def __call__(self, batch: PackedBatch, cache: PagedHybridCache, rows: torch.Tensor | None,
                 meta: StepMetadata, hidden: list[torch.Tensor] | None) -> torch.Tensor: ...


class EagerExecutor:
    """The model's modules: takes every step."""

    name = "eager"

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        self.model = model

    def why_not(self, meta: StepMetadata, num_logits: int) -> str | None:
        return None

    def __call__(self, batch: PackedBatch, cache: PagedHybridCache, rows: torch.Tensor | None,
                 meta: StepMetadata, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        return self.model.forward_packed(batch, cache, rows, meta, hidden)


class GraphExecutor:
    """The model's whole decode step in one native call over one cache (module docstring);
    bound again when the model's parameters are replaced (``PARAMETER_EPOCH``)."""

    name = "graph"

    def __init__(self, model: Qwen35ForCausalLM, cache: PagedHybridCache, stack: Any) -> None:
        self.model, self.cache, self.stack = model, cache, stack
        self.backend, self.epoch = model.backend, PARAMETER_EPOCH[0]

    @classmethod
    def bind(cls, model: Qwen35ForCausalLM, cache: PagedHybridCache
             ) -> tuple[GraphExecutor | None, str]:
        """The executor over ``cache``, or None and why it does not apply."""
        stack, why = model.decode_graph(cache)
        return (None, why) if stack is None else (cls(model, cache, stack), "")

    def why_not(self, meta: StepMetadata, num_logits: int) -> str | None:
        if self.backend is not self.model.backend or self.epoch != PARAMETER_EPOCH[0]:
            stack, why = self.model.decode_graph(self.cache)  # weights or bundle changed
            if stack is None:
                return why
            self.stack = stack
            self.backend, self.epoch = self.model.backend, PARAMETER_EPOCH[0]
        return self.stack.why_not(meta, num_logits)

    def __call__(self, batch: PackedBatch, cache: PagedHybridCache, rows: torch.Tensor | None,
                 meta: StepMetadata, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        assert cache is self.cache
        logits, last = self.stack(batch.input_ids, meta,
                                  self.model.rope.upto(max(meta.total_lens)), rows,
                                  hidden is not None)
        if hidden is not None:
            hidden.append(last)
        return logits


class LayersExecutor:
    """Each layer that has a fused call (``DecoderLayer.fused_why_not``: the bundle's, over
    pages in the model dtype, without experts) runs as one native call, the others their
    modules, for a step of decodes and verify chunks whose products the bundle fuses at the
    step's rows (``Backend.fused.why_not``)."""

    name = "layers"

    def __init__(self, model: Qwen35ForCausalLM, cache: PagedHybridCache,
                 flags: tuple[bool, ...]) -> None:
        self.model, self.cache, self.flags = model, cache, flags
        self.backend, self.epoch = model.backend, PARAMETER_EPOCH[0]
        layers = [la for la, f in zip(model.model.layers, flags, strict=True) if f]
        self.products = list({(id(m), q): (m, q) for m, q in (la.product() for la in layers)
                              }.values())
        # verify chunks go through a fused Gated DeltaNet layer only with its capsule
        self.captures = all(cache.capsules.get(la.index) is not None for la in layers
                            if not la.is_full)

    @classmethod
    def bind(cls, model: Qwen35ForCausalLM, cache: PagedHybridCache
             ) -> tuple[LayersExecutor | None, str]:
        """The executor over ``cache``, or None and why no layer fuses."""
        if model.parallel.tp_world_size != 1:
            return None, "tensor parallelism"
        why = [la.fused_why_not(model.backend, cache) for la in model.model.layers]
        if all(why):
            return None, str(why[0]) if why else "no layers"
        return cls(model, cache, tuple(w is None for w in why)), ""

    def why_not(self, meta: StepMetadata, num_logits: int) -> str | None:
        if self.backend is not self.model.backend or self.epoch != PARAMETER_EPOCH[0]:
            again, why = LayersExecutor.bind(self.model, self.cache)  # weights or bundle changed
            if again is None:
                return why
            self.__dict__.update(again.__dict__)
        fused = self.backend.fused
        assert fused is not None
        if not meta.all_decode and not self.captures:
            return "verify chunks without the layers' capsules"
        for matmul, quantized in self.products:
            why = fused.why_not(meta, meta.num_tokens, self.model.dtype, matmul, quantized)
            if why is not None:
                return why
        return None

    def __call__(self, batch: PackedBatch, cache: PagedHybridCache, rows: torch.Tensor | None,
                 meta: StepMetadata, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        return self.model.forward_packed(batch, cache, rows, meta, hidden, self.flags)


class Executors:
    """A runner's executors over its cache, in the order they are asked: the graph one and the
    layers one where they bind, then the eager one."""

    def __init__(self, model: Qwen35ForCausalLM, cache: PagedHybridCache) -> None:
        self.eager = EagerExecutor(model)
        self.graph, self.graph_why_not = GraphExecutor.bind(model, cache)
        self.layers, self.layers_why_not = LayersExecutor.bind(model, cache)
        self.steps = {"graph": 0, "layers": 0, "eager": 0}  # steps each ran

    def choose(self, meta: StepMetadata, num_logits: int) -> Executor:
        """The first executor that takes the step (one test each, on the step's metadata)."""
        chosen: Executor = self.eager
        for ex in (self.graph, self.layers):
            if ex is not None and ex.why_not(meta, num_logits) is None:
                chosen = ex
                break
        self.steps[chosen.name] += 1
        return chosen

    def describe(self) -> str:
        """The kernel line's part: what each step kind runs on, or why not."""
        parts = ["graph (a decode-only step in one native call)" if self.graph is not None
                 else f"no graph ({self.graph_why_not})",
                 "layers (fused decoder layers for decodes and verify chunks)"
                 if self.layers is not None else f"no fused layers ({self.layers_why_not})",
                 "else eager"]
        return "executors: " + ", ".join(parts)
