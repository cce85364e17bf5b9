#!/usr/bin/env bash
# Set up, then run the whole test suite on the default torchtitan line (0.2.2, in .venv) and the tests
# marked both_lines on the other (0.3.0, in .venv-tt03). pytest's "no tests collected" (exit 5) is a
# failure here; each run ends with its 25 slowest tests (to keep CI in its budget). Arguments go to
# both pytest runs (e.g. -x, -k ...). TT03=0 skips the 0.3 run.
set -uo pipefail
cd "$(dirname "$0")/.."

run_pytest() {  # venv, then pytest's arguments
  local venv="$1"
  shift
  OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q --durations=25 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests in $venv: failing" >&2
    return 1
  fi
  return "$rc"
}

bash scripts/setup.sh || exit 1
run_pytest .venv "$@"
rc=$?
if [ "${TT03:-1}" != "0" ]; then
  echo "== torchtitan 0.3.0 (.venv-tt03): the tests marked both_lines =="
  TORCHTITAN=0.3.0 VENV=.venv-tt03 bash scripts/setup.sh || exit 1
  run_pytest .venv-tt03 -m both_lines "$@"
  rc03=$?
  [ "$rc" -ne 0 ] || rc=$rc03
fi
exit "$rc"
