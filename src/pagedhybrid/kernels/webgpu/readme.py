# ruff: noqa: E501  (markdown text of the card is kept verbatim, one paragraph per line)
"""The kernel card (``README.md``) of the PagedAttention package, rendered from its manifest.

Same sections as the published ``webgpu-kernels`` cards: description, inputs / outputs /
attributes tables with bind keys, type constraints, device requirements, files and usage (the JS
``@huggingface/kernels`` call plus this project's Python loader).
"""

from __future__ import annotations

from typing import Any

_HEADER = """---
library_name: kernels
license: apache-2.0
tags:
- kernel
- webgpu
- wgsl
---
# {op}

`{domain}`  ·  ONNX Runtime contrib operator  ·  contrib since_version {since}

## Description

{description}

See the [ONNX Runtime `{name}` contrib-operator spec](https://github.com/microsoft/onnxruntime/blob/main/docs/ContribOperators.md#{op}) for the reference semantics.
"""

_USAGE = """## Use with `@huggingface/kernels`

The loader derives every required output's shape and logical dtype from the manifest contract and this call.
It then allocates the result tensors automatically.

The `version: 1` option selects the published kernel contract; it is independent of any operator opset, contrib `since_version`, or model version.

Replace each `*Data` placeholder with a typed array containing the corresponding input data.

```js
import {{ getKernel }} from "@huggingface/kernels";

const kernel = await getKernel("webgpu-kernels/{op}", {{ version: 1 }});
const {{ keyCacheT, valueCacheT, outputT }} = await kernel({{
  queryT: {{ data: queryTData, shape: [2, 16] }},
  keyT: {{ data: keyTData, shape: [2, 8] }},
  valueT: {{ data: valueTData, shape: [2, 8] }},
  keyCacheT: {{ data: keyCacheTData, shape: [3, 16, 1, 8] }},
  valueCacheT: {{ data: valueCacheTData, shape: [3, 16, 1, 8] }},
  cumulativeSequenceLengthT: {{ data: cumulativeSequenceLengthTData, shape: [2] }},
  pastSeqlensT: {{ data: pastSeqlensTData, shape: [1] }},
  blockTableT: {{ data: blockTableTData, shape: [1, 3] }},
}}, {{
  attrs: {{ num_heads: 2, kv_num_heads: 1 }},
}});
```

## Use from Python (pagedhybrid)

```python
from pagedhybrid.kernels.webgpu import GpuTensor, get_kernel

kernel = get_kernel("{op}", version=1)
caches = {{"keyCacheT": GpuTensor.from_numpy(key_cache),
          "valueCacheT": GpuTensor.from_numpy(value_cache)}}  # resident on the device
out = kernel({{"queryT": q, "keyT": k, "valueT": v, **caches,
              "cumulativeSequenceLengthT": cu, "pastSeqlensT": past, "blockTableT": table}},
             attrs={{"num_heads": 2, "kv_num_heads": 1}})
out["outputT"]            # numpy float16 [num_tokens, num_heads * head_size]
out["keyCacheT"] is caches["keyCacheT"]  # updated in place on the device
```

`pagedhybrid kernels test` runs `test.json` against the torch reference on the local adapter;
`pagedhybrid kernels bench` runs `bench.json` beside ONNX Runtime's own WebGPU PagedAttention.
Unsupported ONNX Runtime ports, attributes and dtypes are rejected before any GPU work.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_readme(m: dict[str, Any]) -> str:
    op = f"{m['domain']}.{m['name']}"
    out = [_HEADER.format(op=op, domain=m["domain"], since=m["sinceVersion"], name=m["name"],
                          description=m["description"])]
    tc = m["typeConstraints"]

    def storage(p: dict[str, Any]) -> str:
        return f"`{p['storage']}`" if "storage" in p else "same as logical dtype"

    out.append("## Inputs\n")
    out.append("| Name | Bind key | Logical dtype | WebGPU storage | Rank | Shape | Description "
               "| Presence |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, p in m["inputs"].items():
        out.append(f"| `{p['onnx']}` | `{key}` | `{p['dtype']}` | {storage(p)} | "
                   f"`{p.get('rank', '—')}` | — | {_cell(p['description'])} | "
                   f"{'optional' if p.get('optional') else 'required'} |")
    out.append("\n## Outputs\n")
    out.append("| Name | Bind key | Logical dtype | Rank | Shape | Description | Presence |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for key, p in m["outputs"].items():
        name = p["onnx"].removesuffix("_out")
        shape = ("derived; see description" if "shape" in p
                 else f"same as `{m['inputs'][key]['onnx']}`")
        out.append(f"| `{name}` | `{key}` | `{p['dtype']}` | `{p.get('rank', '—')}` | {shape} | "
                   f"{_cell(p['description'])} | "
                   f"{'optional' if p.get('optional') else 'required'} |")
    out.append("\n## Attributes\n")
    out.append("Attributes and default values (overridable per request):\n")
    out.append("| Attribute | Default | Description |")
    out.append("| --- | --- | --- |")
    for name, a in m["attributes"].items():
        default = f"`{a['default']}`" if "default" in a else "—"
        out.append(f"| `{name}` | {default} | {_cell(a['description'])} |")
    out.append("\n## Type constraints\n")
    out.append("| Variable | Allowed dtypes |")
    out.append("| --- | --- |")
    for var, types in tc.items():
        out.append(f"| `{var}` | {', '.join(f'`{t}`' for t in types)} |")
    feats = ", ".join(f"`{f}`" for f in m["requires"]["features"])
    out.append("\n## Device requirements\n")
    out.append(f"Every implementation variant requires {feats}; the package has no "
               "variant-level fallback without that capability.\n")
    out.append("## Variants\n")
    out.append("| Variant | Priority | Passes | Description |")
    out.append("| --- | --- | --- | --- |")
    for v in m["variants"]:
        passes = " → ".join(f"`{p['id']}`" for p in v["passes"])
        out.append(f"| `{v['id']}` | {v['priority']} | {passes} | {_cell(v['description'])} |")
    out.append("\nThe attention template renders one of two bodies for the device it runs on: with "
               "`subgroups` (an 8-invocation workgroup forming one subgroup) and `head_size % 32 == 0`, "
               "each invocation owns a slice of the head channels and `q·k` is finished with "
               "`subgroupAdd`; otherwise one invocation per query row reads K/V at addresses "
               "shared by the whole workgroup. The `useSubgroups` tunable forces the portable body. "
               "Scores, softmax statistics and accumulators are float32; caches and outputs float16.")
    out.append("\n## Files\n")
    files = [("metadata.json", "kernel metadata (id, digests, provenance)"),
             ("manifest.json", "the op contract (source of truth)"),
             ("test.json", "correctness cases (project-defined schema, see its header)"),
             ("bench.json", "benchmark + tuning cases (project-defined schema)")]
    for f, what in files:
        out.append(f"- [`{f}`](build/webgpu/{f}) — {what}")
    shaders = sorted({p["shader"] for v in m["variants"] for p in v["passes"]})
    out.extend(f"- [`{s}`](build/webgpu/{s})" for s in shaders)
    out.append("")
    out.append(_USAGE.format(op=op))
    return "\n".join(out).rstrip("\n") + "\n"
