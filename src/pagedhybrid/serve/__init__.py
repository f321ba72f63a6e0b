"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, Prometheus metrics).

* ``core.py``     -- the engine in its own process (vLLM's engine core), fed over pipes.
* ``protocol.py`` -- OpenAI request bodies and the OpenAI error object.
* ``app.py``      -- the endpoints: completions, chat completions, models, health, metrics;
  ``state.py`` (the server's state and checks), ``generate.py`` (a generation request's choices
  through the engine, waited for or streamed), ``handlers.py`` (errors no route answers),
  ``openapi.py`` (the document of every answer).
* ``responses.py`` -- the answers' shapes: choices, stop strings, logprobs, usage, chunks.
* ``metrics.py``  -- ``pagedhybrid:*`` Prometheus metrics (vLLM's names).
* ``cli.py``      -- ``pagedhybrid serve``.
* ``replicas.py`` -- ``pagedhybrid serve --replicas N``: N engine replicas behind one endpoint on
  Ray Serve (the ray extra): ``replica_deployments.py`` (the replicas and the ingress),
  ``replica_routing.py`` / ``replica_router.py`` (prefix-aware routing on the engine's page
  hashes), ``replica_metrics.py`` (per-replica and aggregated metrics).
"""
