"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, Prometheus metrics).

* ``loop.py``     -- ``EngineLoop``: the engine stepping on its own thread, fed from asyncio.
* ``protocol.py`` -- OpenAI request bodies and the OpenAI error object.
* ``app.py``      -- the endpoints: completions, chat completions, models, health, metrics.
* ``responses.py`` -- the answers' shapes: choices, stop strings, logprobs, usage, chunks.
* ``metrics.py``  -- ``pagedhybrid:*`` Prometheus metrics (vLLM's names).
* ``cli.py``      -- ``pagedhybrid serve``.
"""
