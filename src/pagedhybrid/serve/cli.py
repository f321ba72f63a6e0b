"""``pagedhybrid serve [MODEL_DIR] [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
[engine options as in generate] [--max-waiting N] [--api-key KEY] [--shutdown-timeout S]
[--chat-template FILE] [--tensor-parallel-size N [--distributed-executor-backend mp|ray|
external_launcher]] [--replicas N [--min-replicas A --max-replicas B] [--ray-address ADDR]
[--cpus-per-replica C] [--router prefix|round_robin|random]]``.

``--replicas`` serves N engine replicas (each one ``pagedhybrid serve``, possibly tensor-parallel)
behind one endpoint on Ray Serve with the prefix-aware router (``serve/replicas.py``).

Loads the model (the built-in one by default) into an ``Engine`` in a process of its own
(``core.EngineClient``, as vLLM's engine core) and serves the OpenAI API with uvicorn on
loopback by default. SIGTERM / SIGINT stop accepting connections, let in-flight requests finish
for up to ``--shutdown-timeout`` seconds (then fail them: each client gets a last answer -- 503,
or a streamed error chunk -- never a cut connection), stop the engine process and exit 0. The
API key can also come from ``PAGEDHYBRID_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedhybrid.errors import PagedHybridError


def register_subcommands(subparsers: Any) -> None:
    from pagedhybrid.serve.offline_cli import add_engine_arguments

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server over the engine")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="HF Qwen3.5 checkpoint folder (default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the folder's name)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="queued requests beyond which new ones get HTTP 503 (default: no "
                   "limit; requests queue as in vLLM, each costing its token ids until admitted)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDHYBRID_API_KEY"),
                   help="require 'Authorization: Bearer KEY'")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may finish in after SIGTERM")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template's text) used instead "
                   "of the checkpoint's")
    p.add_argument("--log-level", default="warning")
    add_engine_arguments(p)
    from pagedhybrid.serve.replicas import add_replica_arguments

    add_replica_arguments(p)  # --replicas N ... (Ray Serve; ray is imported only when used)
    p.set_defaults(func=serve_main)


def serve_parser() -> argparse.ArgumentParser:
    """The ``pagedhybrid serve`` parser alone (engine, server and replica options)."""
    sub = argparse.ArgumentParser(prog="pagedhybrid").add_subparsers(dest="command")
    register_subcommands(sub)
    p: argparse.ArgumentParser = sub.choices["serve"]
    p.prog = "pagedhybrid serve"
    return p


def build_state(args: argparse.Namespace) -> Any:
    """Start the engine process and the server's state around it (tokenizer, metrics)."""
    import functools

    from pagedhybrid.engine.core.config import SpeculativeConfig
    from pagedhybrid.engine.loader import load_engine
    from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
    from pagedhybrid.serve.core import EngineClient
    from pagedhybrid.serve.metrics import ServerMetrics
    from pagedhybrid.serve.offline_cli import _engine_kwargs
    from pagedhybrid.serve.state import ServerState

    model_dir = Path(args.model_dir or args.model or default_model_dir())
    spec = SpeculativeConfig.of(args.speculative_config)  # refused here, by field
    core = EngineClient.launch(functools.partial(load_engine, model_dir, dtype=args.dtype,
                                                 **_engine_kwargs(args)))
    info = core.info
    if not info.has_tokenizer:
        core.stop()
        raise PagedHybridError(f"{model_dir} has no tokenizer; the server needs one")
    name = args.served_model_name or model_dir.name
    metrics = ServerMetrics(name, spec.num_speculative_tokens if spec else 0)
    core.on_step = metrics.on_step
    tokenizer = load_tokenizer(model_dir, info.vocab_size)
    if args.chat_template is not None:
        if not hasattr(tokenizer, "chat_template"):
            core.stop()
            raise PagedHybridError(f"{model_dir}'s tokenizer renders no chat template")
        source = Path(args.chat_template)
        tokenizer.chat_template = source.read_text() if source.is_file() else args.chat_template
    return ServerState(core, tokenizer, name,
                       info.max_model_len, info.vocab_size, metrics, args.api_key,
                       args.max_waiting, str(model_dir))


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedhybrid.serve.app import create_app
    from pagedhybrid.serve.offline_cli import worker_rank

    if getattr(args, "replicas", None) is not None:  # N engine replicas behind one endpoint
        from pagedhybrid.serve.replicas import serve_replicas

        return serve_replicas(args, serve_parser())
    if (code := worker_rank(args)) is not None:  # a tensor-parallel rank of rank 0's engine
        return code
    try:
        state = build_state(args)
    except PagedHybridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = state.core.info
    print(f"pagedhybrid serve: {state.model_name} on http://{args.host}:{args.port} "
          f"(max_model_len {state.max_model_len}; kernels: {info.kernel_summary})",
          file=sys.stderr, flush=True)
    print(f"pagedhybrid serve: {info.memory_summary}", file=sys.stderr, flush=True)
    # uvicorn cancels what still runs at its own deadline (a traceback per connection), so the
    # engine fails the in-flight requests at ``--shutdown-timeout`` and the handlers get a
    # moment after it to send those last answers
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port,
                            log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + _ANSWER_GRACE_S)
    _GracefulServer(config, lambda: state.core.close(
        f"the server is shutting down (the {args.shutdown_timeout:g} s allowed to finish "
        "passed)"), args.shutdown_timeout).run()
    print("pagedhybrid serve: stopped", file=sys.stderr)
    return 0


_ANSWER_GRACE_S = 5.0


class _GracefulServer:
    """uvicorn's server, but a SIGTERM/SIGINT shutdown is a normal exit (status 0) -- uvicorn
    re-raises the captured signal after its graceful shutdown, which would kill the process --
    and ``on_deadline`` runs ``deadline`` seconds after the first signal."""

    def __new__(cls, config: Any, on_deadline: Callable[[], None], deadline: float) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            timer: threading.Timer | None = None

            def handle_exit(self, sig: int, frame: Any) -> None:
                super().handle_exit(sig, frame)
                self._captured_signals.clear()  # handled: nothing to re-raise at exit
                if self.timer is None:
                    self.timer = threading.Timer(deadline, on_deadline)
                    self.timer.daemon = True
                    self.timer.start()

        return Server(config)
