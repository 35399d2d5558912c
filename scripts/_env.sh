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
    # Not byte-compiled by pip (on one core): compileall does it on every core after the installs, below.
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
    if ! "$PY" -c "import torch" 2>/dev/null; then
        quiet_pip "$TORCH_REQ"
    fi
    # A path entry (.pth), not an import hook: a folder named shardkit in the working directory (the
    # clone itself, seen from its parent) must not shadow the package as an empty namespace.
    quiet_pip -e "$ROOT${EXTRAS:+[$EXTRAS]}" --config-settings editable_mode=compat
    # Every installed module compiled once, on every core (pip compiles on one: 55 s of the 96 s install). Not
    # left to first imports: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) no .pyc would
    # ever be written, and every process of the tests would compile each module it imports (a run took 16
    # minutes instead of 10). Files that are not Python 3, which some packages ship, stay uncompiled, as pip
    # leaves them.
    "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null 2>&1 || true
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
