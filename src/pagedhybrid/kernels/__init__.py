"""Implementations of the operator contracts beside the references in ``pagedhybrid.ops``.

* ``registry`` -- the one kernel registry: ``Backend`` (a kernel bundle), its typed
  ``BundleCapability``, ``Needs`` and ``KernelRegistry.select(needs)`` (the bundle and every
  rejection with its reason);
* ``backend``  -- the four bundles (``native``, ``native_batch_invariant``, ``torch``,
  ``reference``) declared in the process's ``REGISTRY``; ``select(needs=...)``;
* ``cpu`` (vectorised torch) · ``native`` (C++ extension) · ``webgpu`` (WGSL package + loader) ·
  ``onnxruntime`` (checks against ORT's kernels); ``step`` / ``reference``: the model's
  step metadata and its reference step seam.

Nothing here imports a later layer; the attention layer's contract dispatch queries
``backend.REGISTRY`` (``pagedhybrid.attention.backends``).
"""
