"""The worker: ``ModelRunner`` (``runner.py``), the step's sampling over its requests
(``sampling.py``), tensor-parallel ranks (``distributed.py``) and the thread governor
(``contention.py``).
"""
