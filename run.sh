#!/usr/bin/env bash
# kvfleet's two entry points on a fresh machine (Debian + Python >= 3.11 + pip):
#   bash run.sh demo [kvfleet demo flags]   start a local cluster, run the demo workload, stop
#   bash run.sh test [pytest args]          run the test suite
#   bash run.sh up   [kvfleet up flags]     start a local cluster and serve until Ctrl-C
#   bash run.sh bench [bench flags]         run the benchmarks
#   bash run.sh lint                        ruff + mypy over router worker allocator deploy kvfleet
# Each call creates/updates .venv; all but lint also install redis-server (Debian) when missing
# and prepare the default model once (~1 min the first time; `up`/`demo --model NAME` of another
# known model prepares that one too), so nothing else needs doing by hand.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

die() { echo "run.sh: $*" >&2; exit 1; }

pick_python() {
  for py in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then echo "$py"; return; fi
  done
  die "Python >= 3.11 is required (set PYTHON=/path/to/python3.11)"
}

ensure_venv() {
  if [ ! -x .venv/bin/python ]; then
    "$(pick_python)" -m venv .venv || die "could not create .venv (Debian: apt-get install -y python3-venv)"
  fi
  local stamp=.venv/.kvfleet-installed want
  want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "run.sh: installing kvfleet and its dependencies into .venv (first time: a few minutes)…" >&2
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # torch==2.13.0 is pinned in pyproject.toml: a CPU build; never let a resolver pick a CUDA one.
    .venv/bin/python -m pip install -q -e '.[dev,prepare]' || die "pip install failed (see above)"
    echo "$want" > "$stamp"
  fi
}

ensure_redis() {
  command -v redis-server >/dev/null 2>&1 && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing redis-server (Debian package)…" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >&2 \
      || die "apt-get install redis-server failed; install it yourself or pass --redis-url"
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server \
      || die "could not install redis-server; install it yourself (apt-get install redis-server)"
  else
    die "redis-server is missing: install it (Debian: apt-get install redis-server; macOS: brew install redis)"
  fi
}

ensure_model() {
  .venv/bin/kvfleet model prepare >&2 || die "model preparation failed (see above)"
  # `up`/`demo --model NAME` of another known model (not a directory): prepare it too.
  local want="" prev=""
  for arg in "$@"; do
    case "$arg" in --model=*) want="${arg#--model=}" ;; esac
    [ "$prev" = "--model" ] && want="$arg"
    prev="$arg"
  done
  if [ -n "$want" ] && [ ! -d "$want" ]; then
    .venv/bin/kvfleet model prepare "$want" >&2 || die "model preparation failed (see above)"
  fi
}

lint() {
  # Settings in pyproject.toml ([tool.ruff], [tool.mypy]). mypy checks the installed layout
  # (kvfleet.router is router/, …), so it runs over a tree of symlinks shaped like it.
  local top rc=0
  top=$(pwd)
  LINT_TREE=$(mktemp -d)
  trap 'rm -rf "$LINT_TREE"' EXIT
  mkdir "$LINT_TREE/kvfleet"
  for f in kvfleet/*; do ln -s "$top/$f" "$LINT_TREE/kvfleet/"; done
  for d in router worker allocator deploy; do ln -s "$top/$d" "$LINT_TREE/kvfleet/$d"; done
  echo "== ruff" >&2
  .venv/bin/ruff check --output-format concise router worker allocator deploy kvfleet || rc=1
  echo "== mypy" >&2
  (cd "$LINT_TREE" && "$top/.venv/bin/mypy" --config-file "$top/pyproject.toml" \
      --cache-dir "$top/.mypy_cache" -p kvfleet) \
    | sed -E 's#^kvfleet/(router|worker|allocator|deploy)/#\1/#' || rc=1
  return "$rc"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)  ensure_venv; ensure_redis; ensure_model "$@"; exec .venv/bin/kvfleet demo "$@" ;;
  up)    ensure_venv; ensure_redis; ensure_model "$@"; exec .venv/bin/kvfleet up "$@" ;;
  test)  ensure_venv; ensure_redis; ensure_model; exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@" ;;
  bench) ensure_venv; ensure_redis; ensure_model; exec .venv/bin/python -m bench "$@" ;;
  lint)  ensure_venv; lint ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
