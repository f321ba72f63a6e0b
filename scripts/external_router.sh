#!/usr/bin/env bash
# Route two pagedhybrid replicas with NVIDIA Dynamo's KV-event router (scripts/external_router.py).
# The router goes into a venv of its own (ROUTER_VENV, default /tmp/pagedhybrid-dynamo-venv),
# never into the project's: only the ai-dynamo-runtime wheel (Rust indexer + selection service;
# its deps are pydantic and uvloop). The full `ai-dynamo` package is not needed, and its
# `aisimulate` dependency is an NVIDIA wheel stub that downloads from outside PyPI at install.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${ROUTER_VENV:-/tmp/pagedhybrid-dynamo-venv}"
version="${DYNAMO_VERSION:-1.6.1}"
py="${PYTHON:-$here/.venv/bin/python}"
if ! "$venv/bin/python" -c "import dynamo.select_service" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "ai-dynamo-runtime==$version"
fi
cd "$here"
exec "$py" scripts/external_router.py --router-python "$venv/bin/python" "$@"
