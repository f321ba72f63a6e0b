"""Run an exported package in onnxruntime the way a serving runtime does (tests, benchmarks).

``PackedGraphSession(package_dir, num_blocks)`` opens ``model.onnx`` with the WebGPU plugin EP
(PagedAttention runs there; GatedDeltaNet and VarlenCausalConvWithState fall back to the CPU EP of
onnxruntime >= 1.32) and allocates the page buffers of every full-attention layer **on the
device**, bound in place (one OrtValue as ``past_key_values.i.key`` and ``present.i.key``)
through IOBinding. ``placement="paged_only"`` (the default) keeps the accumulating nodes -- every
MatMul (and MatMulNBits), norm and reduction -- on the CPU EP (the WebGPU EP's
``forceCpuNodeNames``; its float16 MatMul accumulates in float32 there), and all other nodes too
while their names fit ONNX Runtime's 8192-character option value; with
``placement="webgpu"`` the WebGPU EP takes every node it has a kernel for (its float16 MatMul
accumulates in float16). Fixed states are passed per step in batch order (row ``b`` = ``b``-th
sequence of ``cumulative_sequence_lengths``) and are also bound in place (one host OrtValue as
input and output), so ``step`` returns the updated rows in the arrays it was given.

The layer partition and block size are read back from the package's ``genai_config.json``, so the
runner assumes nothing the export does not write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.kernels.onnxruntime.session import webgpu_ep_device

OP = "pagedhybrid.export.PackedGraphSession"


PAGED_ONLY = "paged_only"  # PagedAttention on WebGPU, every other node on the CPU EP
WEBGPU = "webgpu"  # every node the WebGPU EP claims runs there (fp16 MatMul accumulates in fp16)


ACCUMULATING = ("MatMul", c.MATMUL_NBITS, "Gemm", "SimplifiedLayerNormalization",
                "SkipSimplifiedLayerNormalization", "GatedRMSNorm", "ReduceSumSquare",
                c.GATED_DELTA_NET, c.VARLEN_CONV, c.MOE)
OPTION_LIMIT = 8192  # onnxruntime's longest config value


def ep_options(model_path: str | Path, placement: str) -> dict[str, str]:
    """WebGPU EP options; ``paged_only`` pins non-PagedAttention nodes to the CPU EP
    (accumulating ones first, the rest while the option value has room)."""
    if placement == WEBGPU:
        return {}
    if placement != PAGED_ONLY:
        raise UnsupportedConfiguration(
            f"placement {placement!r}: use {PAGED_ONLY!r} or {WEBGPU!r}")
    import onnx_ir as ir

    nodes = [n for n in ir.load(model_path).graph if n.op_type != c.PAGED_ATTENTION and n.name]
    nodes.sort(key=lambda n: n.op_type not in ACCUMULATING)  # stable: accumulating first
    names, size = [], 0
    for n in nodes:
        if size + len(n.name) + 1 > OPTION_LIMIT:
            if n.op_type in ACCUMULATING:
                raise UnsupportedConfiguration(
                    f"placement {PAGED_ONLY!r}: the graph's accumulating node names exceed "
                    f"onnxruntime's {OPTION_LIMIT}-character option; use {WEBGPU!r}")
            break
        names.append(n.name)
        size += len(n.name) + 1
    return {"forceCpuNodeNames": "\n".join(names)}


def batch_inputs(batch: Any) -> dict[str, np.ndarray]:
    """A ``models.qwen35.PackedBatch``'s step inputs as ``PackedGraphSession.step`` takes them
    (keyword arguments, numpy)."""
    return {name: getattr(batch, name).numpy() for name in (
        "input_ids", "position_ids", "cu_seqlens", "past_seqlens", "block_table",
        "attention_metadata")}


class StepOutput(NamedTuple):
    logits: np.ndarray  # float32 [N or B, V]
    conv: dict[int, np.ndarray]  # layer -> [B, conv_dim, K-1] (the arrays passed in, updated)
    recurrent: dict[int, np.ndarray]  # layer -> float32 [B, Hv, Dv, Dk]
    # --state-update-capacity packages: output name -> the step's compact state updates
    updates: dict[str, np.ndarray] | None = None
    # --mtp packages: the main graph's hidden_states / the head's hidden_states_out [N, hidden]
    hidden: np.ndarray | None = None


class PackedGraphSession:
    """The package's main graph, or with ``graph=mtp.onnx`` its MTP head graph (one
    full-attention layer, its own pages, the ``hidden_states`` input)."""

    def __init__(self, package_dir: str | Path, num_blocks: int,
                 placement: str = PAGED_ONLY, graph: str = c.MODEL_FILE) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.dir = Path(package_dir)
        self.graph = graph
        genai = json.loads((self.dir / c.GENAI_CONFIG_FILE).read_text())
        groups = {g["kind"]: g["layer_ids"] for g in genai["model"]["decoder"]["state_groups"]}
        head = graph == c.MTP_FILE
        self.full_layers: list[int] = [c.MTP_LAYER] if head else groups[c.GROUP_PAGED_KV]
        self.linear_layers: list[int] = [] if head else groups.get(c.GROUP_FIXED_CONV, [])
        self.block_size = int(genai["engine"]["dynamic_batching"]["block_size"])
        self.num_blocks = num_blocks
        self.device = webgpu_ep_device()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_provider_for_devices([self.device], ep_options(self.dir / graph, placement))
        if placement == PAGED_ONLY:
            # A fused Gemm would get a new name and land on WebGPU; a fused SkipSimplified-
            # LayerNormalization keeps the residual sum in float32 only where no node sits between
            # the Add and the norm, so the pruned graph (a Gather there) would round differently.
            so.add_session_config_entry("optimization.disable_specified_optimizers",
                                        "MatMulAddFusion,SkipLayerNormFusion")
        self.session = ort.InferenceSession(str(self.dir / graph), sess_options=so)
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._mem = self.device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        key = self._inputs[c.PAST_KEY % self.full_layers[0]]
        self.io_dtype = np.float16 if key.type == "tensor(float16)" else np.float32
        self.page_shape = (num_blocks, self.block_size, *key.shape[2:])
        self.pages: dict[str, Any] = {}
        for i in self.full_layers:
            for name in (c.PAST_KEY % i, c.PAST_VALUE % i):
                self.pages[name] = self._device_array(np.zeros(self.page_shape, self.io_dtype))

    # -- page buffers (device) ---------------------------------------------------------------
    def _device_array(self, host: np.ndarray) -> Any:
        ort = self._ort
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(host.shape), host.dtype,
                                                          memory_info=self._mem)
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(host))], [value])
        return value

    def write_pages(self, layer: int, key: np.ndarray, value: np.ndarray) -> None:
        """Overwrite a layer's page buffers (e.g. with garbage, to test reuse without clearing)."""
        self.pages[c.PAST_KEY % layer] = self._device_array(key.astype(self.io_dtype))
        self.pages[c.PAST_VALUE % layer] = self._device_array(value.astype(self.io_dtype))

    def read_pages(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        ort = self._ort
        out = []
        for name in (c.PAST_KEY % layer, c.PAST_VALUE % layer):
            host = ort.OrtValue.ortvalue_from_numpy(np.empty(self.page_shape, self.io_dtype))
            ort.copy_tensors([self.pages[name]], [host])
            out.append(np.array(host.numpy()))
        return out[0], out[1]

    # -- one step ---------------------------------------------------------------------------
    def step(self, *, input_ids: np.ndarray, position_ids: np.ndarray, cu_seqlens: np.ndarray,
             past_seqlens: np.ndarray, block_table: np.ndarray,
             attention_metadata: np.ndarray, conv: dict[int, np.ndarray],
             recurrent: dict[int, np.ndarray], capture_count: np.ndarray | None = None,
             hidden_states: np.ndarray | None = None) -> StepOutput:
        """One step; in a package exported with ``--state-update-capacity``, ``capture_count``
        (int ``[B]``) asks each sequence's first tokens' compact state updates (None: capture
        off, ``state_update_active = [0]``), returned in ``StepOutput.updates``; the MTP graph
        takes ``hidden_states`` (``[N, hidden]``); a graph's hidden output comes back in
        ``StepOutput.hidden``."""
        ort = self._ort
        capturing = c.STATE_UPDATE_CAPTURE_COUNT in self._inputs
        io = self.session.io_binding()
        feeds = {c.INPUT_IDS: input_ids.astype(np.int64), c.POSITION_IDS: position_ids.astype(
            np.int64), c.CU_SEQLENS: cu_seqlens.astype(np.int32),
            c.PAST_SEQLENS: past_seqlens.astype(np.int32),
            c.BLOCK_TABLE: block_table.astype(np.int32),
            c.ATTENTION_METADATA: attention_metadata.astype(np.int32)}
        if capturing:
            batch = len(cu_seqlens) - 1
            feeds[c.STATE_UPDATE_CAPTURE_COUNT] = (np.zeros(batch, np.int32) if capture_count
                                                   is None else capture_count.astype(np.int32))
            feeds[c.STATE_UPDATE_ACTIVE] = np.array([int(capture_count is not None)], np.int32)
        elif capture_count is not None:
            raise ContractViolation(OP, "capture_count", "needs a package exported with "
                                    "--state-update-capacity", capture_count.shape)
        if c.HIDDEN_STATES in self._inputs:
            if hidden_states is None:
                raise ContractViolation(OP, "hidden_states", f"is an input of {self.graph}",
                                        None)
            feeds[c.HIDDEN_STATES] = hidden_states.astype(self.io_dtype)
        for name, arr in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(arr))
        for i in self.full_layers:
            for past, present in ((c.PAST_KEY % i, c.PRESENT_KEY % i),
                                  (c.PAST_VALUE % i, c.PRESENT_VALUE % i)):
                io.bind_ortvalue_input(past, self.pages[past])
                io.bind_ortvalue_output(present, self.pages[past])
        for i in self.linear_layers:
            for past, present, arr in ((c.PAST_CONV % i, c.PRESENT_CONV % i, conv[i]),
                                       (c.PAST_RECURRENT % i, c.PRESENT_RECURRENT % i,
                                        recurrent[i])):
                if not arr.flags["C_CONTIGUOUS"]:
                    raise ContractViolation(OP, past, "must be a C-contiguous array (it is "
                                            "bound in place)")
                value = ort.OrtValue.ortvalue_from_numpy(arr)  # shares arr's memory
                io.bind_ortvalue_input(past, value)
                io.bind_ortvalue_output(present, value)
        names = [o.name for o in self.session.get_outputs()
                 if o.name.startswith("state_update.")
                 or o.name in (c.HIDDEN_STATES, c.HIDDEN_STATES_OUT)]
        for name in [*names, c.LOGITS]:  # get_outputs() is in binding order
            io.bind_output(name, "cpu")
        self.session.run_with_iobinding(io)
        values = dict(zip([*names, c.LOGITS], io.get_outputs()[-1 - len(names):], strict=True))
        hidden = next((np.array(values.pop(n).numpy()) for n in (c.HIDDEN_STATES,
                                                                 c.HIDDEN_STATES_OUT)
                       if n in values), None)
        updates = {n: np.array(v.numpy()) for n, v in values.items() if n != c.LOGITS}
        return StepOutput(np.array(values[c.LOGITS].numpy()), conv, recurrent, updates, hidden)
