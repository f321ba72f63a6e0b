"""The engine's core (vLLM v1's ``core/``): requests, the scheduler, KV pages and state slots,
configs, the memory plan, stats, KV events, the output types and the detokenizer.
"""
