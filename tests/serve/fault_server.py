"""``pagedhybrid serve`` with faults injected, for the fault tests (never shipped).

A request carrying one of the poison token ids below in its prompt trips a fault in one place of
the engine or the server: at intake (``add_request``), in scheduling (admission), inside the
model step (``forward_packed``), in sampling, in the bookkeeping after the step (finishing), in
the metrics hook. Detokenisation faults on generated token ``DETOK`` (force it with
``logit_bias``). Everything else is the real server.
"""

from __future__ import annotations

import sys

INTAKE, SCHED, STEP, SAMPLE, FINISH, HOOK, DETOK = 3001, 3002, 3003, 3004, 3005, 3006, 3007


class InjectedFault(RuntimeError):
    pass


def install() -> None:
    import pagedhybrid.engine.worker.sampling as sampling_mod
    from pagedhybrid.engine import Engine
    from pagedhybrid.engine.core.request import Request
    from pagedhybrid.engine.core.scheduler import HybridAllocator
    from pagedhybrid.models.qwen35 import Qwen35ForCausalLM
    from pagedhybrid.models.qwen35.tokenizer import TokenizersTokenizer
    from pagedhybrid.serve.metrics import ServerMetrics

    def patch(owner: object, name: str, wrap):  # type: ignore[no-untyped-def]
        setattr(owner, name, wrap(getattr(owner, name)))

    patch(Engine, "add_request", lambda f: lambda self, rid, prompt, params=None: (
        _raise("intake") if INTAKE in prompt else f(self, rid, prompt, params)))
    patch(HybridAllocator, "admit", lambda f: lambda self, req, budget: (
        _raise("admission") if SCHED in req.prompt_token_ids else f(self, req, budget)))
    patch(Qwen35ForCausalLM, "forward_packed", lambda f: lambda self, batch, *a, **k: (
        _raise("step") if bool((batch.input_ids == STEP).any()) else f(self, batch, *a, **k)))
    patch(sampling_mod, "sample", lambda f: lambda logits, params, gens, history=None,
          *rest: (_raise("sampling") if history is not None and any(
              SAMPLE in h.prompt_token_ids for h in history)
              else f(logits, params, gens, history, *rest)))
    patch(Request, "append", lambda f: lambda self, tok, eos, n: (
        _raise("finishing") if FINISH in self.prompt_token_ids else f(self, tok, eos, n)))
    patch(ServerMetrics, "on_step", lambda f: lambda self, engine, outs: (  # first deltas
        _raise("hook") if any(HOOK in (o.prompt_token_ids or ()) for o in outs)
        else f(self, engine, outs)))
    patch(TokenizersTokenizer, "decode", lambda f: lambda self, ids, *a, **k: (
        _raise("detokenisation") if DETOK in list(ids) else f(self, ids, *a, **k)))


def _raise(where: str) -> None:
    raise InjectedFault(f"injected fault: {where}")


if __name__ == "__main__":
    install()
    from pagedhybrid.cli import main

    sys.exit(main(sys.argv[1:]))
