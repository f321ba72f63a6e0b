"""Sampling: ``SamplingParams`` and the sampler (``sampler.py``), grammars for structured outputs
(``structured.py``).
"""
