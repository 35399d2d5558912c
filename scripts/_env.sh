# Sourced by scripts/demo and scripts/test: make .venv in the repo and install shardkit into it.
# SHARDKIT_EXTRAS names the extras to add (scripts/test sets "dev": the test and lint tools and the
# libraries shardkit is tested against; scripts/demo installs shardkit and its dependencies only).
# SHARDKIT_TORCH overrides the torch requirement (default: the CPU build this project's
# machines carry; on a GPU machine set e.g. SHARDKIT_TORCH="torch>=2.13").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_REQ="${SHARDKIT_TORCH:-torch==2.13.0}"
EXTRAS="${SHARDKIT_EXTRAS:-}"

quiet_pip() {
    # pip warns about every local index folder it skips; keep the log readable.
    local log status=0
    log="$(mktemp)"
    # Not byte-compiled by pip (55 s on one core): each module is compiled at its first import, below.
    "$VENV/bin/pip" install --disable-pip-version-check --no-compile -q "$@" >"$log" 2>&1 || status=$?
    grep -v "is ignored: it is neither" "$log" || true
    rm -f "$log"
    return "$status"
}

if [ ! -x "$PY" ]; then
    echo "creating virtual environment in $VENV"
    python3 -m venv "$VENV"
fi
STAMP="$VENV/.shardkit-install-stamp${EXTRAS:+-$EXTRAS}"
STAMPS=("$STAMP")
# The demo needs no extras: the test install (a superset) serves it too.
if [ -z "$EXTRAS" ]; then STAMPS+=("$VENV/.shardkit-install-stamp-dev"); fi
installed() {
    local s
    for s in "${STAMPS[@]}"; do
        if [ -f "$s" ] && [ ! "$ROOT/pyproject.toml" -nt "$s" ]; then return 0; fi
    done
    return 1
}
if ! installed || ! "$PY" -c "import shardkit, torch" 2>/dev/null; then
    echo "installing shardkit and its dependencies into .venv (first run takes a few minutes)"
    # torch and the rest in one resolve; torch is left as it is where it imports.
    TORCH_ARGS=()
    "$PY" -c "import torch" 2>/dev/null || TORCH_ARGS=("$TORCH_REQ")
    # A path entry (.pth), not an import hook: a folder named shardkit in the working directory (the
    # clone itself, seen from its parent) must not shadow the package as an empty namespace.
    quiet_pip "${TORCH_ARGS[@]}" -e "$ROOT${EXTRAS:+[$EXTRAS]}" --config-settings editable_mode=compat
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# Each module is compiled at its first import and its .pyc kept (in .venv and the clone's __pycache__ folders).
# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) no .pyc would ever be written, and every
# process of the tests would compile each module it imports again (a run took 16 minutes instead of 10).
# Compiling all ~18,000 installed modules up front instead took 30 s; the tests import about a quarter of them.
unset PYTHONDONTWRITEBYTECODE
