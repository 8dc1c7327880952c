#!/usr/bin/env bash
# Idempotent installer for the Python MCP test helpers (tests/mcp/*.py).
#
# Creates/refreshes a venv at <repo>/target/mcp-venv (so `cargo clean` removes
# it) holding the exact packages pinned in tests/mcp/requirements.txt, and
# prints the venv's python path as the ONLY line on stdout. Everything else
# goes to stderr.
#
# The venv is rebuilt when requirements.txt or the base interpreter changes
# (sha256 stamp inside the venv). Concurrent callers are serialized with
# flock(1) when available, so parallel test binaries may all call this.
#
# Env overrides: MCP_VENV (venv dir), PYTHON (base interpreter, default python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${MCP_VENV:-$root/target/mcp-venv}"
req="$here/requirements.txt"
base_python="${PYTHON:-python3}"
stamp="$venv/.requirements.stamp"

mkdir -p "$(dirname "$venv")"

# Serialize concurrent installs (the lock file lives beside the venv, not in it,
# because a rebuild deletes the venv).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$venv.lock"
    flock 9
fi

base_id="$("$base_python" -c 'import sys; print(sys.executable, sys.version)')"
want="$( { sha256sum "$req" | cut -d' ' -f1; echo "$base_id"; } | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c '' >/dev/null 2>&1; then
    echo "$venv/bin/python"
    exit 0
fi

echo "install.sh: creating $venv from $base_python ($base_id)" >&2
rm -rf "$venv"
if ! "$base_python" -m venv "$venv" >&2; then
    # Debian/Ubuntu ship venv/ensurepip separately (python3-venv / python3.X-venv).
    rm -rf "$venv"
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    if command -v apt-get >/dev/null 2>&1 && { [ ${#sudo[@]} -eq 0 ] || command -v sudo >/dev/null 2>&1; }; then
        minor="$("$base_python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
        echo "install.sh: '$base_python -m venv' failed; installing python3-venv via apt" >&2
        export DEBIAN_FRONTEND=noninteractive
        "${sudo[@]}" apt-get update -qq >&2
        "${sudo[@]}" apt-get install -y -qq python3-venv >&2 ||
            "${sudo[@]}" apt-get install -y -qq "python${minor}-venv" >&2
        "$base_python" -m venv "$venv" >&2
    else
        echo "install.sh: '$base_python -m venv' failed; install python3-venv" >&2
        exit 1
    fi
fi

PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
    "$venv/bin/python" -m pip install --quiet -r "$req" >&2

echo "$want" >"$stamp"
echo "$venv/bin/python"
