# Shared by the install-*.sh scripts (sourced, not run): one virtualenv per peer under .venv-peers/ (or
# $FLEETROUTE_PEERS_DIR), the pinned version from versions.env, and nothing done when that version is there
# already. Each install writes <peer>/fleetroute-install.json (version, seconds taken, size on disk).
set -euo pipefail

PEERS_SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS_ROOT="${FLEETROUTE_PEERS_DIR:-$(cd "$PEERS_SRC/../.." && pwd)/.venv-peers}"
PYTHON="${PYTHON:-python3}"
# shellcheck source=versions.env
source "$PEERS_SRC/versions.env"

# pip's own noise about this machine's unused extra indexes, filtered from its stderr.
_quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# install_pip_peer NAME DIST VERSION [EXTRAS]: pip-install DIST[EXTRAS]==VERSION into $PEERS_ROOT/NAME.
install_pip_peer() {
    local name="$1" dist="$2" version="$3" extras="${4:-}"
    local venv="$PEERS_ROOT/$name"
    if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null)" == "$version" ]]; then
        echo "$name: $dist $version already installed in $venv"
        return 0
    fi
    local started=$SECONDS
    mkdir -p "$PEERS_ROOT"
    [[ -x "$venv/bin/python" ]] || "$PYTHON" -m venv "$venv"
    _quiet_pip "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$dist$extras==$version"
    record_install "$name" "$version" $((SECONDS - started)) "$(du -sm "$venv" | cut -f1)" "$venv"
}

# record_install NAME VERSION SECONDS SIZE_MB WHERE: print and keep what the install took.
record_install() {
    local name="$1" version="$2" seconds="$3" size_mb="$4" where="$5"
    mkdir -p "$PEERS_ROOT/$name"
    printf '{"peer": "%s", "version": "%s", "install_seconds": %s, "size_mb": %s, "path": "%s"}\n' \
        "$name" "$version" "$seconds" "$size_mb" "$where" > "$PEERS_ROOT/$name/fleetroute-install.json"
    echo "$name: installed $version in ${seconds}s, ${size_mb} MB at $where"
}
