"""Python loader of WebGPU kernel packages: ``get_kernel(op_id, version=1)`` -> callable kernel.

Mirrors ``@huggingface/kernels``' ``getKernel``: the returned kernel is called as
``kernel(inputs: dict[bind_key, array], attrs=..., args=..., tunables=..., output="cpu")`` and
returns ``dict[bind_key, array]``. Before any GPU work it

1. checks the bound ports against the manifest (unknown key, missing required port, dtype from
   ``typeConstraints``, rank); ONNX Runtime ports and attributes the package does not implement
   (``manifest.onnx.unsupported*``) raise UnsupportedConfiguration, everything else malformed
   raises ContractViolation;
2. resolves attributes (defaults, required, allowed values) and runs the op contract's own
   ``pagedhybrid.ops.paged_attention.validate`` so shape and value rules are written once;
3. derives every required output's shape and dtype from the manifest (``outputs[].shape``, inout
   ports take the input's shape), then picks the variant, renders and runs its passes.

Inputs are numpy arrays, CPU torch tensors or ``GpuTensor`` (device-resident; keep KV caches
there between calls). The caches are bound read-write once and updated in place: the returned
``keyCacheT``/``valueCacheT`` are the caller's own objects (host arrays/tensors are written back).
``output="gpu"`` returns ``outputT`` as a ``GpuTensor`` the caller owns.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pagedhybrid import dtypes
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.webgpu import executor, runner
from pagedhybrid.kernels.webgpu.package import WGSL_SCALAR, KernelPackage, evaluate, package_dir
from pagedhybrid.kernels.webgpu.runner import GpuTensor


def _logical(x: Any) -> str:
    """The logical dtype of a bound value; an unknown one keeps its own name (the port check
    then rejects it)."""
    if isinstance(x, GpuTensor):
        return x.dtype
    dt = x.dtype if isinstance(x, torch.Tensor) else np.asarray(x).dtype
    e = dtypes.find(dt)
    return str(dt) if e is None else e.logical


class WebGpuKernel:
    """One loaded package; call it like the JS kernel. ``last`` describes the latest call."""

    def __init__(self, package: KernelPackage) -> None:
        self.package = package
        self.manifest = package.manifest
        self.op_id = package.op_id
        self.pool = runner.BufferPool()
        self.last: dict[str, Any] = {}
        onnx = self.manifest.get("onnx", {})
        self._onnx_inputs = {p: p for p in onnx.get("inputs", [])}
        self._unsupported_inputs = set(onnx.get("unsupportedInputs", []))
        self._unsupported_attrs: dict[str, Any] = onnx.get("unsupportedAttributes", {})

    # -- contract checks ----------------------------------------------------------------------
    def _fail(self, where: str, rule: str, got: object = None) -> ContractViolation:
        return ContractViolation(self.op_id, where, rule, got)

    def check_ports(self, inputs: Mapping[str, Any]) -> dict[str, str]:
        """Presence, dtype and rank of each bound input; returns bind key -> logical dtype."""
        from pagedhybrid.kernels.webgpu.manifest_gen import bind_key

        ports = self.manifest["inputs"]
        unsupported = {bind_key(n): n for n in self._unsupported_inputs}
        for key, value in inputs.items():
            if key in ports:
                continue
            onnx_name = unsupported.get(key) or (key if key in self._unsupported_inputs else None)
            if onnx_name is not None:
                if value is None:
                    continue
                raise UnsupportedConfiguration(
                    f"{self.op_id}: input '{onnx_name}' (bind key {bind_key(onnx_name)}) is part "
                    "of ONNX Runtime's PagedAttention but not implemented by this WebGPU "
                    "package; leave it unbound (run the torch reference for it)")
            raise self._fail(key, f"is not a port of this kernel; ports: {sorted(ports)}")
        bound: dict[str, str] = {}
        tvars: dict[str, tuple[str, str]] = {}
        for key, port in ports.items():
            value = inputs.get(key)
            if value is None:
                if not port.get("optional"):
                    raise self._fail(key, f"is a required input (ONNX '{port['onnx']}')",
                                     "missing")
                continue
            if not isinstance(value, GpuTensor | np.ndarray | torch.Tensor):
                raise self._fail(key, "must be a numpy array, torch tensor or GpuTensor",
                                 type(value).__name__)
            dt = _logical(value)
            tvar = port["dtype"]
            allowed = self.manifest["typeConstraints"].get(tvar, [tvar])
            if dt not in allowed:
                onnx = self.manifest.get("onnx", {})
                param = onnx.get("inputTypes", {}).get(port["onnx"])
                if dt in onnx.get("typeConstraints", {}).get(param, []):
                    raise UnsupportedConfiguration(
                        f"{self.op_id}: '{key}' is {dt}, which ONNX Runtime accepts but this "
                        f"WebGPU package does not; it takes {allowed} ({tvar})")
                raise self._fail(key, f"must have element type in {allowed} ({tvar})", dt)
            prev = tvars.setdefault(tvar, (dt, key))
            if prev[0] != dt:
                raise self._fail(key, f"must share its element type with '{prev[1]}' ({tvar})",
                                 f"{dt} vs {prev[0]}")
            rank = len(value.shape)
            if "rank" in port and rank != port["rank"]:
                raise self._fail(key, f"must have rank {port['rank']}", rank)
            bound[key] = dt
        return bound

    def resolve_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        declared = self.manifest["attributes"]
        rules = self.manifest.get("attributeConstraints", {})
        out: dict[str, Any] = {}
        for name, value in attrs.items():
            if name in declared:
                continue
            if name in self._unsupported_attrs:
                default = self._unsupported_attrs[name]
                if value == default or (name.endswith("cache_dtype") and value == "float16"):
                    continue  # the ONNX Runtime default: nothing asked of us
                raise UnsupportedConfiguration(
                    f"{self.op_id}: attribute {name}={value!r} is valid in ONNX Runtime but not "
                    f"implemented by this WebGPU package (only {name}={default!r})")
            raise self._fail(name, f"is not an attribute of this kernel; attributes: "
                             f"{sorted(declared)}", value)
        for name, decl in declared.items():
            rule = rules.get(name, {})
            if name in attrs:
                value = attrs[name]
            elif "default" in decl:
                value = decl["default"]
            elif rule.get("required"):
                raise self._fail(name, "is a required attribute", "missing")
            else:
                continue
            if "values" in rule and value not in rule["values"]:
                raise UnsupportedConfiguration(
                    f"{self.op_id}: {name}={value!r} is not supported by this WebGPU package; "
                    f"supported: {rule['values']}")
            out[name] = value
        return out

    def _contract(self, inputs: Mapping[str, Any], attrs: Mapping[str, Any]) -> Any:
        """The op contract's validate() over the call (device tensors as meta tensors)."""
        from pagedhybrid.ops import op_module

        spec_mod = op_module(self.op_id)
        onnx_names = self.manifest["onnx"]["inputs"]
        by_onnx = {p["onnx"]: k for k, p in self.manifest["inputs"].items()}
        tensors: list[torch.Tensor | None] = []
        for name in onnx_names:
            v = inputs.get(by_onnx.get(name, ""))
            if v is None:
                tensors.append(None)
            elif isinstance(v, GpuTensor):
                tensors.append(torch.empty(v.shape, dtype=dtypes.to_torch(v.dtype),
                                           device="meta"))
            elif isinstance(v, torch.Tensor):
                tensors.append(v)
            else:
                tensors.append(torch.from_numpy(np.ascontiguousarray(v)))
        return spec_mod.validate(tensors, dict(attrs))

    # -- the call -----------------------------------------------------------------------------
    def __call__(self, inputs: Mapping[str, Any], attrs: Mapping[str, Any] | None = None, *,
                 args: Mapping[str, Any] | None = None,
                 tunables: Mapping[str, Any] | None = None,
                 output: str = "cpu") -> dict[str, Any]:
        if output not in ("cpu", "gpu"):
            raise self._fail("output", "must be 'cpu' or 'gpu'", output)
        inputs = {k: v for k, v in inputs.items() if v is not None or k not in
                  self.manifest["inputs"]}
        bound = self.check_ports(inputs)
        inputs = {k: v for k, v in inputs.items() if k in self.manifest["inputs"]}
        resolved = self.resolve_attrs(dict(attrs or {}))
        dims = self._contract(inputs, resolved)
        call_args = self._call_args(dims, args)
        tun = self._tunables(tunables)
        ctx = runner.gpu()
        scope = self._scope(ctx, inputs, bound, call_args, resolved, tun)
        out_specs = self._infer_outputs(scope)
        for key, (_, dt) in out_specs.items():
            scope["logicalDtypes"].setdefault(key, dt)
            scope["dtypes"].setdefault(key, WGSL_SCALAR.get(dt, dt))
        executor.evaluate_derive(self.manifest.get("derive", {}), scope)
        if dims.num_tokens == 0:  # nothing to scatter or attend: no GPU work at all
            shape, dt = out_specs["outputT"]
            result: dict[str, Any] = {"outputT": np.zeros(shape, dtypes.numpy_dtype(dt))}
            self.last = {"variant": None, "dispatches": []}
            return {**result, **{k: inputs[k] for k in out_specs if k in inputs}}
        self._check_sizes(ctx, inputs, bound, out_specs)
        buffers, owned = self._bind_buffers(inputs, out_specs, output)
        plan = executor.plan(self.package, scope, buffers, self.pool, ctx.features)
        runner.run_dispatches(plan.dispatches)
        self.last = {"variant": plan.variant, "dispatches": [(d.name, d.workgroups)
                                                             for d in plan.dispatches],
                     "derive": dict(scope["derive"])}
        return self._results(inputs, out_specs, buffers, owned)

    def _call_args(self, dims: Any, args: Mapping[str, Any] | None) -> dict[str, int]:
        """The call's ``args`` (upper bounds), each at least the contract's own value."""
        call_args = {"maxQueryLen": dims.max_query_len, "maxKvLen": dims.max_kv_len}
        for name, value in (args or {}).items():
            if name not in self.manifest.get("args", {}):
                raise self._fail(name, f"is not an argument of this kernel; args: "
                                 f"{sorted(self.manifest.get('args', {}))}", value)
            floor = call_args[name]
            if int(value) < floor:
                raise self._fail(name, f"is an upper bound and must be >= {floor}", value)
            call_args[name] = int(value)
        return call_args

    def _tunables(self, tunables: Mapping[str, Any] | None) -> dict[str, Any]:
        """The manifest's tunable defaults with the call's overrides."""
        tun = {k: t["default"] for k, t in self.manifest.get("tunables", {}).items()}
        for name, value in (tunables or {}).items():
            if name not in tun:
                raise self._fail(name, f"is not a tunable; tunables: {sorted(tun)}", value)
            tun[name] = value
        return tun

    def _scope(self, ctx: Any, inputs: dict[str, Any], bound: dict[str, str],
               call_args: dict[str, int], resolved: dict[str, Any],
               tun: dict[str, Any]) -> dict[str, Any]:
        """The manifest expressions' evaluation scope for this call (``derive`` still empty)."""
        shapes = {k: list(map(int, v.shape)) for k, v in inputs.items()}
        return {
            "shapes": shapes, "ranks": {k: len(s) for k, s in shapes.items()},
            "logicalDtypes": dict(bound), "tensorDtypes": dict(bound),
            "dtypes": {k: WGSL_SCALAR.get(d, d) for k, d in bound.items()},
            "present": {k: k in inputs for k in self.manifest["inputs"]},
            "args": call_args, "attrs": resolved, "tunables": tun,
            "device": {"features": sorted(ctx.features), "limits": ctx.limits,
                       "adapterInfo": ctx.info},
            "env": {"device": {"features": sorted(ctx.features)}}, "derive": {},
        }

    def _check_sizes(self, ctx: Any, inputs: dict[str, Any], bound: dict[str, str],
                     out_specs: dict[str, tuple[list[int], str]]) -> None:
        """Every input and output fits one storage buffer binding of this device."""
        biggest = ctx.limits.get("max-storage-buffer-binding-size", 1 << 27)
        sizes = {k: int(np.prod(v.shape)) * dtypes.itemsize(bound[k]) for k, v in inputs.items()}
        sizes.update({k: int(np.prod(s)) * dtypes.itemsize(d) for k, (s, d) in out_specs.items()})
        for key, nbytes in sizes.items():
            if nbytes > biggest:
                raise UnsupportedConfiguration(
                    f"{self.op_id}: '{key}' needs {nbytes} bytes, above this device's "
                    f"max-storage-buffer-binding-size ({biggest}); use smaller tensors per call")

    def _bind_buffers(self, inputs: dict[str, Any], out_specs: dict[str, tuple[list[int], str]],
                      output: str) -> tuple[dict[str, Any], dict[str, GpuTensor]]:
        """GPU buffers per bind key: device inputs as they are, host inputs uploaded to pooled
        buffers, outputs pooled (``cpu``) or new caller-owned ``GpuTensor`` (``gpu``, returned
        as the second dict); inout ports keep the input's buffer."""
        buffers: dict[str, Any] = {}
        for key, value in inputs.items():
            if isinstance(value, GpuTensor):
                buffers[key] = value.buffer
            else:
                arr = (value.detach().cpu().numpy() if isinstance(value, torch.Tensor)
                       else np.asarray(value))
                buf = self.pool.buffer(f"in:{key}", arr.nbytes)
                runner.write_buffer(buf, arr)
                buffers[key] = buf
        owned: dict[str, GpuTensor] = {}
        for key, (shape, dt) in out_specs.items():
            if key in inputs:
                continue  # inout: the cache buffer itself
            if output == "gpu":
                owned[key] = GpuTensor.empty(tuple(shape), dt)
                buffers[key] = owned[key].buffer
            else:
                nbytes = int(np.prod(shape)) * dtypes.itemsize(dt)
                buffers[key] = self.pool.buffer(f"out:{key}", nbytes)
        return buffers, owned

    @staticmethod
    def _results(inputs: dict[str, Any], out_specs: dict[str, tuple[list[int], str]],
                 buffers: dict[str, Any], owned: dict[str, GpuTensor]) -> dict[str, Any]:
        """The call's outputs: inout ports are the caller's own objects (host caches written
        back), ``gpu`` outputs their ``GpuTensor``, the rest read back to numpy."""
        result: dict[str, Any] = {}
        for key, (shape, dt) in out_specs.items():
            if key in inputs:
                value = inputs[key]
                if not isinstance(value, GpuTensor):  # host cache: write the update back
                    fresh = GpuTensor(buffers[key], tuple(shape), dt).numpy()
                    if isinstance(value, torch.Tensor):
                        value.copy_(torch.from_numpy(fresh))
                    else:
                        np.copyto(value, fresh)
                result[key] = value
            elif key in owned:
                result[key] = owned[key]
            else:
                result[key] = GpuTensor(buffers[key], tuple(shape), dt).numpy()
        return result

    def _infer_outputs(self, scope: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
        """Shape and logical dtype of every output this call produces (manifest rules)."""
        out: dict[str, tuple[list[int], str]] = {}
        for key, port in self.manifest["outputs"].items():
            tvar = port.get("dtype", "float32")
            dt = scope["logicalDtypes"].get(key) or next(
                (scope["logicalDtypes"][k] for k, p in self.manifest["inputs"].items()
                 if p.get("dtype") == tvar and k in scope["logicalDtypes"]), None)
            dt = dt or self.manifest["typeConstraints"].get(tvar, [tvar])[0]
            if "shape" in port:
                shape = [int(s) for s in evaluate(port["shape"], scope)]
                if any(s < 0 for s in shape):
                    raise self._fail(key, "derived a negative output dimension", shape)
            elif key in scope["shapes"]:
                shape = scope["shapes"][key]
            elif port.get("optional"):
                continue
            else:
                raise self._fail(key, "has no shape expression; pass it as an explicit "
                                 "destination or declare outputs[].shape in the manifest")
            out[key] = (shape, dt)
        return out


@functools.cache
def _load(root: str, verify: bool) -> WebGpuKernel:
    return WebGpuKernel(KernelPackage(root, verify=verify))


def get_kernel(op_id: str, version: int = 1, *, package: str | None = None,
               verify_hashes: bool = True) -> WebGpuKernel:
    """The kernel of package ``op_id`` (contract ``version``), loaded once per process."""
    if version != 1:
        raise UnsupportedConfiguration(f"{op_id}: only kernel contract version 1 is published")
    root = package_dir(op_id, package)
    kernel = _load(str(root.resolve()), verify_hashes)
    if kernel.op_id != op_id:
        raise ContractViolation(op_id, "package", "must hold the requested op id", kernel.op_id)
    return kernel
