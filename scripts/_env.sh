# Sourced by scripts/demo and scripts/test: make .venv in the repo and install shardkit into it.
# SHARDKIT_TORCH overrides the torch requirement (default: the CPU build this project's
# machines carry; on a GPU machine set e.g. SHARDKIT_TORCH="torch>=2.13").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_REQ="${SHARDKIT_TORCH:-torch==2.13.0}"

quiet_pip() {
    # pip warns about every local index folder it skips; keep the log readable.
    local log status=0
    log="$(mktemp)"
    "$VENV/bin/pip" install --disable-pip-version-check -q "$@" >"$log" 2>&1 || status=$?
    grep -v "is ignored: it is neither" "$log" || true
    rm -f "$log"
    return "$status"
}

if [ ! -x "$PY" ]; then
    echo "creating virtual environment in $VENV"
    python3 -m venv "$VENV"
fi
STAMP="$VENV/.shardkit-install-stamp"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || ! "$PY" -c "import shardkit, torch" 2>/dev/null; then
    echo "installing shardkit and its dependencies into .venv (first run takes a few minutes)"
    if ! "$PY" -c "import torch" 2>/dev/null; then
        quiet_pip "$TORCH_REQ"
    fi
    quiet_pip -e "$ROOT[dev]"
    touch "$STAMP"
fi
# The latency-mount tests (tests/test_prefetch.py, scripts/latency_mount.py) need FUSE 3: fusermount3 and
# libfuse3 (Debian package fuse3). Installed only when missing; without it those tests skip with the reason.
if ! command -v fusermount3 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing fuse3 (for the latency-mount tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q fuse3 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fuse3 >/dev/null 2>&1; } \
        || echo "fuse3 could not be installed: the latency-mount tests will skip"
fi
export PATH="$VENV/bin:$PATH"
