"""Run rendered WGSL compute passes on a wgpu device (wgpu-py; lavapipe here, any adapter).

* ``gpu()`` requests the adapter and device once per process, mimicking the JS loader: every
  known feature the adapter has (``shader-f16`` is mandatory: without it this raises
  UnsupportedConfiguration) and the adapter's own storage limits. With subgroups, the subgroup
  size of an 8-invocation workgroup is probed once (``info["subgroupMinSize"]``).
* ``GpuTensor`` is a device-resident tensor (buffer + shape + logical dtype): pass it as an input
  to keep a KV cache on the device between calls; the cache outputs are then the very same objects.
* Compiled pipelines are cached per WGSL source text (the rendered template, so per
  template + defines) for the life of the process.
* ``Dispatch`` is one resolved pass (pipeline, ordered binding resources, workgroup counts);
  ``run_dispatches`` encodes them in one compute pass, which orders storage writes of one dispatch
  before reads of the next, and submits once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.kernels.webgpu.package import WGSL_SCALAR

_WANTED_LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size",
                  "max-storage-buffers-per-shader-stage", "max-compute-workgroup-storage-size",
                  "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x")
# JS-loader feature names -> wgpu-py names.
_FEATURE_NAMES = {"shader-f16": "shader-f16", "subgroups": "subgroup",
                  "timestamp-query": "timestamp-query"}


@dataclass
class GpuContext:
    adapter: Any
    device: Any
    features: frozenset[str]  # JS-loader feature names
    limits: dict[str, int]
    info: dict[str, Any]
    pipelines: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    compile_seconds: float = 0.0
    compiles: int = 0


@functools.cache
def gpu() -> GpuContext:
    """The process-wide wgpu device; raises UnsupportedConfiguration without ``shader-f16``."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu
    except ImportError as exc:  # pragma: no cover - wgpu is a dependency
        raise UnsupportedConfiguration(
            "the WebGPU kernels need `pip install wgpu==0.32.0`") from exc
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None:
        raise UnsupportedConfiguration(
            "no WebGPU adapter: install a Vulkan driver (on a CPU-only machine Mesa's lavapipe, "
            "`make system-deps`)")
    have = set(adapter.features)
    info = dict(adapter.info)
    if "shader-f16" not in have:
        raise UnsupportedConfiguration(
            f"WebGPU adapter {info.get('device')!r} ({info.get('backend_type')}) lacks "
            "'shader-f16', which every variant of the PagedAttention package requires; install "
            "a Vulkan driver with f16 support (Mesa lavapipe: `make system-deps`) or select it "
            "with WGPU_BACKEND_TYPE=Vulkan")
    features = [w for js, w in _FEATURE_NAMES.items() if w in have]
    limits = {k: adapter.limits[k] for k in _WANTED_LIMITS if k in adapter.limits}
    device = adapter.request_device_sync(required_features=features, required_limits=limits)
    js = frozenset(js for js, w in _FEATURE_NAMES.items() if w in have)
    ctx = GpuContext(adapter, device, js, dict(device.limits), info)
    if "subgroups" in js:
        ctx.info["subgroupMinSize"] = _probe_subgroup_size(ctx)
    return ctx


_PROBE = """
@group(0) @binding(0) var<storage, read_write> seen: array<u32>;
@compute @workgroup_size(8)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) size: u32) {
  seen[i] = subgroupAdd(1u) * 1000u + size;
}
"""


def _probe_subgroup_size(ctx: GpuContext) -> int:
    """The subgroup size an 8-invocation workgroup runs with, 0 if subgroupAdd over it does not
    see all 8 invocations. wgpu-py 0.32 does not report the adapter's subgroupMinSize (it reads a
    misspelled field and returns the spec defaults), so it is observed instead."""
    import wgpu

    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
    buf = ctx.device.create_buffer(size=32, usage=usage)
    layout = ctx.device.create_bind_group_layout(entries=[
        {"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
         "buffer": {"type": wgpu.BufferBindingType.storage}}])
    pipe = ctx.device.create_compute_pipeline(
        layout=ctx.device.create_pipeline_layout(bind_group_layouts=[layout]),
        compute={"module": ctx.device.create_shader_module(code=_PROBE), "entry_point": "main"})
    group = ctx.device.create_bind_group(layout=layout, entries=[
        {"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": 32}}])
    encoder = ctx.device.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    cpass.set_pipeline(pipe)
    cpass.set_bind_group(0, group)
    cpass.dispatch_workgroups(1, 1, 1)
    cpass.end()
    ctx.device.queue.submit([encoder.finish()])
    seen = np.frombuffer(ctx.device.queue.read_buffer(buf), np.uint32)
    buf.destroy()
    sums, sizes = seen // 1000, seen % 1000
    return int(sizes.min()) if bool(np.all(sums == 8)) else 0


class GpuTensor:
    """A tensor resident in a device buffer (shape, logical dtype); ``numpy()`` reads it back."""

    def __init__(self, buffer: Any, shape: tuple[int, ...], dtype: str) -> None:
        self.buffer, self.shape, self.dtype = buffer, tuple(int(s) for s in shape), dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * dtypes.itemsize(self.dtype)

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: str) -> GpuTensor:
        import wgpu

        nbytes = int(np.prod(shape)) * dtypes.itemsize(dtype)
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        buf = gpu().device.create_buffer(size=_padded(nbytes), usage=usage)
        return cls(buf, shape, dtype)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> GpuTensor:
        dtype = dtypes.logical_name(array.dtype, op="GpuTensor", where="array")
        if dtype not in WGSL_SCALAR:
            raise UnsupportedConfiguration(
                f"GpuTensor: {dtype} has no WGSL storage type; use one of {list(WGSL_SCALAR)}")
        t = cls.empty(array.shape, dtype)
        t.write(array)
        return t

    def write(self, array: np.ndarray) -> None:
        write_buffer(self.buffer, array)

    def numpy(self) -> np.ndarray:
        if self.nbytes == 0:
            return np.empty(self.shape, dtypes.numpy_dtype(self.dtype))
        raw = gpu().device.queue.read_buffer(self.buffer, 0, _padded(self.nbytes))
        flat = np.frombuffer(raw, dtype=dtypes.numpy_dtype(self.dtype))
        return flat[: int(np.prod(self.shape))].reshape(self.shape).copy()

    def destroy(self) -> None:
        self.buffer.destroy()

    def __repr__(self) -> str:
        return f"GpuTensor(shape={list(self.shape)}, dtype={self.dtype})"


def _padded(nbytes: int) -> int:
    return max(16, -(-nbytes // 16) * 16)


def write_buffer(buffer: Any, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    if data.size == 0:
        return
    if data.size % 4:
        data = np.concatenate([data, np.zeros(4 - data.size % 4, np.uint8)])
    gpu().device.queue.write_buffer(buffer, 0, data)


def pipeline(source: str, entries: list[dict[str, Any]]) -> tuple[Any, Any]:
    """(compute pipeline, bind group layout) of a WGSL source, compiled once per process."""
    import time

    import wgpu

    ctx = gpu()
    hit = ctx.pipelines.get(source)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    kinds = {"uniform": wgpu.BufferBindingType.uniform,
             "storage": wgpu.BufferBindingType.storage,
             "read-only-storage": wgpu.BufferBindingType.read_only_storage}
    layout = ctx.device.create_bind_group_layout(entries=[
        {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
         "buffer": {"type": kinds[e["buffer"]]}} for i, e in enumerate(entries)])
    module = ctx.device.create_shader_module(code=source)
    pipe = ctx.device.create_compute_pipeline(
        layout=ctx.device.create_pipeline_layout(bind_group_layouts=[layout]),
        compute={"module": module, "entry_point": "main"})
    ctx.pipelines[source] = (pipe, layout)
    ctx.compile_seconds += time.perf_counter() - t0
    ctx.compiles += 1
    return pipe, layout


class Dispatch(NamedTuple):
    name: str
    pipeline: Any
    bind_group: Any
    workgroups: tuple[int, int, int]


class BufferPool:
    """One device buffer per role (``in:queryT``, ``scratch:partialOut``, ...), reused across
    calls and grown to the next power of two when a call needs more, so a serving loop whose
    shapes change every step neither reallocates every call nor accumulates buffers. Bind groups
    are cached by (layout, buffers) and dropped whenever a buffer is replaced."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}
        self._groups: dict[tuple[int, tuple[int, ...]], Any] = {}

    def buffer(self, role: str, nbytes: int, *, uniform: bool = False) -> Any:
        import wgpu

        need = _padded(nbytes)
        buf = self._buffers.get(role)
        if buf is not None and buf.size >= need:
            return buf
        limit = gpu().limits.get("max-storage-buffer-binding-size", need)
        size = max(need, min(1 << (need - 1).bit_length(), limit))
        usage = wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        usage |= wgpu.BufferUsage.UNIFORM if uniform else wgpu.BufferUsage.STORAGE
        self._buffers[role] = gpu().device.create_buffer(size=size, usage=usage)
        self._groups.clear()  # they may hold the replaced buffer
        return self._buffers[role]

    def bind_group(self, layout: Any, buffers: list[Any]) -> Any:
        key = (id(layout), tuple(id(b) for b in buffers))
        hit = self._groups.get(key)
        if hit is not None:
            return hit[0]
        if len(self._groups) > 256:
            self._groups.clear()
        group = gpu().device.create_bind_group(layout=layout, entries=[
            {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
            for i, b in enumerate(buffers)])
        self._groups[key] = (group, buffers)  # the buffers stay alive with their group
        return group


def run_dispatches(dispatches: list[Dispatch]) -> None:
    """Encode every dispatch in one compute pass and submit."""
    ctx = gpu()
    encoder = ctx.device.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    for d in dispatches:
        if min(d.workgroups) == 0:
            continue
        cpass.set_pipeline(d.pipeline)
        cpass.set_bind_group(0, d.bind_group)
        cpass.dispatch_workgroups(*d.workgroups)
    cpass.end()
    ctx.device.queue.submit([encoder.finish()])
