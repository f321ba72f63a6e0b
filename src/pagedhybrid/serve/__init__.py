"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, Prometheus metrics).

* ``core.py``     -- the engine in its own process (vLLM's engine core), fed over pipes.
* ``protocol.py`` -- OpenAI request bodies and the OpenAI error object.
* ``app.py``      -- the endpoints: completions, chat completions, models, health, metrics.
* ``responses.py`` -- the answers' shapes: choices, stop strings, logprobs, usage, chunks.
* ``metrics.py``  -- ``pagedhybrid:*`` Prometheus metrics (vLLM's names).
* ``cli.py``      -- ``pagedhybrid serve``.
"""
