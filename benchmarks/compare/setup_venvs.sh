#!/usr/bin/env bash
# Creates the two foreign virtualenvs the side-by-side benchmark runs in (issue #7):
#   $BENCH_VENVS/trl      TRL 1.16.0 + torch 2.13.0 (CPU wheel)
#   $BENCH_VENVS/easydel  EasyDeL 0.3.0 + torch 2.13.0 (CPU wheel) + pillow
# They live outside the project's dependencies on purpose: neither framework is ever added to
# pyproject.toml. Default location: <repo>/.bench-venvs (git-ignored). Each install's log is kept
# beside its venv, and a failed install leaves a FAILED file with the exit status, which the
# harness reports as "unavailable" instead of crashing.
#
# Usage: benchmarks/compare/setup_venvs.sh [trl] [easydel]      (default: both)
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BENCH_VENVS="${BENCH_VENVS:-$ROOT/.bench-venvs}"
PYTHON="${PYTHON:-python3.11}"
mkdir -p "$BENCH_VENVS"

# torch is pinned exactly: pip then takes the CPU wheel that lies on this machine's disk. A looser
# spec makes pip download multi-GB CUDA builds.
declare -A SPECS=(
  [trl]="trl==1.16.0 torch==2.13.0"
  [easydel]="easydel==0.3.0 torch==2.13.0 pillow"
)

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(trl easydel)

status=0
for name in "${targets[@]}"; do
  spec="${SPECS[$name]:-}"
  if [ -z "$spec" ]; then echo "unknown venv '$name' (choose trl or easydel)" >&2; exit 2; fi
  venv="$BENCH_VENVS/$name"
  log="$BENCH_VENVS/$name.install.log"
  rm -f "$BENCH_VENVS/$name.FAILED"
  echo "== $name: $spec -> $venv (log: $log)"
  if [ ! -x "$venv/bin/python" ]; then "$PYTHON" -m venv "$venv" || { status=1; continue; }; fi
  # shellcheck disable=SC2086
  if timeout "${INSTALL_TIMEOUT:-900}" "$venv/bin/python" -m pip install $spec >"$log" 2>&1; then
    "$venv/bin/python" -m pip freeze >"$BENCH_VENVS/$name.freeze.txt"
    echo "   ok"
  else
    rc=$?
    echo "pip install exited $rc; last lines of $log:" >"$BENCH_VENVS/$name.FAILED"
    tail -n 30 "$log" >>"$BENCH_VENVS/$name.FAILED"
    echo "   FAILED (exit $rc), see $BENCH_VENVS/$name.FAILED"
    status=1
  fi
done
exit $status
