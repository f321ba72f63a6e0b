"""Drive onnxruntime-genai 0.18.0's continuous-batching ``Engine`` over an exported package.

``register_webgpu()`` registers the WebGPU plugin EP with genai once per process (genai refuses
a WebGPU model otherwise). ``run_schedule(engine, prompts, max_new, admit_after)`` starts the
requests whose ``admit_after`` is 0, runs ``engine.run`` steps, admits each other request after
that many steps (while the first ones decode), and returns every request's greedy tokens
(``min = max`` generated tokens, so EOS cannot end a request early) and the step count. A request
is closed when its turn finishes: an open genai request is a session that keeps its pages,
states and batch slot for a next turn, so later requests would wait for it forever.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


@functools.cache
def register_webgpu() -> None:
    import onnxruntime_ep_webgpu as wep
    import onnxruntime_genai as og

    os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    og.register_execution_provider_library("WebGpuExecutionProvider", wep.get_library_path())


def run_schedule(engine: Any, prompts: Sequence[Sequence[int]], max_new: int,
                 admit_after: Sequence[int] | None = None,
                 max_steps: int = 500) -> tuple[list[list[int]], int]:
    import onnxruntime_genai as og

    admit_after = list(admit_after) if admit_after is not None else [0] * len(prompts)
    buf = engine.create_event_buffer(64)
    requests: dict[int, Any] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    failures: list[str] = []

    def admit(k: int) -> None:
        req = engine.create_request()
        opts = og.TurnOptions(req)
        opts.set_max_generated_tokens(max_new)
        opts.set_min_generated_tokens(max_new)
        opts.set_do_sample(False)
        req.begin_turn(np.asarray(prompts[k], dtype=np.int32), opts)
        requests[k] = req

    steps = 0
    while True:
        for k, at in enumerate(admit_after):
            if at == steps and k not in requests:
                admit(k)
        if not engine.has_pending_requests() and len(requests) == len(prompts):
            break
        for ev in engine.run(buf):
            k = next(k for k, r in requests.items() if ev.request == r)
            if ev.flags & og.EngineEventFlags.TOKEN:
                tokens[k].append(int(ev.token))
            if ev.flags & og.EngineEventFlags.FAILED:
                failures.append(f"request {k}: {ev.error_code} {ev.finish_reason}")
            if ev.flags & og.EngineEventFlags.TURN_FINISHED:
                ev.request.close()  # an open request keeps its session state and batch slot
        steps += 1
        if steps > max_steps:
            raise AssertionError(f"engine did not finish in {max_steps} steps")
    if failures:
        raise AssertionError("; ".join(failures))
    return tokens, steps
