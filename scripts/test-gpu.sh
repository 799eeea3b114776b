#!/usr/bin/env bash
# The GPU stage (`make test-gpu`; docs/testing.md, "The GPU stage"). Where torch sees N GPUs:
# the `cuda` tests, then the rest of the suite, each in one process and under mpiexec -n N (one
# GPU per local rank, so NCCL is the backend; GPU_RANKS=K runs -n K instead). Every stage has a
# timeout; pytest's exit 5 ("no tests ran"), or `cuda` tests that all skipped on a GPU machine,
# fail it. Without a GPU it says in one line what it skipped and why, then proves the stage is
# not broken: the `cuda` tests must import, be collected (one at least) and skip, in a few
# seconds (the files that mark them only). CUDA_VISIBLE_DEVICES= (empty) asks for that check
# alone on any machine (CI's stage); GPUs that nvidia-smi lists and torch cannot see fail it. Ends with one line "gpu: N passed, N failed, N
# skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
unset MPACCEL_USE_CPU ACCELERATE_USE_CPU  # either would keep every rank on the CPU
VENV=${VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
STAGE_TIMEOUT=${STAGE_TIMEOUT:-1800}
REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
problems=()

# "passed failed skipped" of a stage's junit report
counts() {
  "$PY" - "$@" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
total = [0, 0, 0]
for report in sys.argv[1:]:
    for suite in ET.parse(report).getroot().iter("testsuite"):
        n, skip = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        total = [total[0] + n - bad - skip, total[1] + bad, total[2] + skip]
print(*total)
PYEOF
}

# name, what the stage must show ("some pass" or "all skip"), launcher words..., -- pytest args
stage() {
  local name=$1 expect=$2 launcher=()
  shift 2
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
  shift
  echo "::: gpu stage $name: ${launcher[*]} pytest $*"
  timeout --kill-after=30 "$STAGE_TIMEOUT" "${launcher[@]}" "$PY" -m pytest -q \
    -p no:cacheprovider --junitxml="$REPORTS/$name.xml" "$@"
  local rc=$? passed failed skipped
  case $rc in
    0) ;;
    5) problems+=("$name(no tests: pytest exit 5)") ;;
    124|137) problems+=("$name(timed out after $STAGE_TIMEOUT s)") ;;
    *) problems+=("$name(exit $rc)") ;;
  esac
  [ -s "$REPORTS/$name.xml" ] || return 0
  read -r passed failed skipped < <(counts "$REPORTS/$name.xml")
  if [ "$expect" = "some pass" ] && [ "$passed" = 0 ]; then
    problems+=("$name(every cuda test skipped on a GPU machine)")
  elif [ "$expect" = "all skip" ] && [ "$((passed + failed))" != 0 ]; then
    problems+=("$name($passed passed and $failed failed where all should skip)")
  fi
}

read -r gpus version build < <("$PY" -c 'import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__,
      torch.version.cuda or "none")') || { echo "gpu: cannot import torch with $PY"; exit 1; }
listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')

if [ "$gpus" = 0 ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
    why="CUDA_VISIBLE_DEVICES is empty, which hides every GPU from torch $version"
  elif [ "$listed" -gt 0 ]; then
    why="nvidia-smi lists $listed GPU(s) but torch $version (CUDA build: $build) sees none"
    problems+=("torch sees none of the $listed GPUs nvidia-smi lists")
  else
    why="no GPU on this machine (torch $version, CUDA build: $build; no GPU from nvidia-smi)"
  fi
  echo "gpu: skipped the cuda tests and the NCCL stages (size 1, mpiexec -n <GPUs>): $why;" \
    "a GPU machine needs a CUDA build of torch within setup.cfg's range"
  # only the files that mark a test `cuda`: collecting the whole suite takes 4x as long
  mapfile -t marking < <(grep -rlE --include='*.py' 'mark\.cuda\b' tests | sort)
  stage cuda-collect "all skip" -- -m cuda "${marking[@]}"
else
  ranks=${GPU_RANKS:-$gpus}
  echo "gpu: torch $version (CUDA $build) sees $gpus GPU(s): the cuda tests and the suite" \
    "in one process and under mpiexec -n $ranks (NCCL, one GPU per local rank)"
  stage cuda-size-1 "some pass" -- -m cuda tests
  stage "cuda-n$ranks" "some pass" "$MPIEXEC" -n "$ranks" -- -m "cuda and not launches" tests
  stage size-1 any -- -m "not cuda" tests
  stage "n$ranks" any "$MPIEXEC" -n "$ranks" -- -m "not cuda and not launches" tests
fi

[ "${#problems[@]}" = 0 ] || echo "::: gpu: failed: ${problems[*]}"
shopt -s nullglob
reports=("$REPORTS"/*.xml)
read -r passed failed skipped < <(if [ "${#reports[@]}" = 0 ]; then echo 0 0 0; else
  counts "${reports[@]}"; fi)
echo "gpu: $passed passed, $failed failed, $skipped skipped"
[ "${#problems[@]}" = 0 ]
