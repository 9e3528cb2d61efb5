#!/usr/bin/env bash
# Issue 4's GPU proof on the lent H200: the driver of the recorded runs (docs/results/).
# Run from the repo root on the GPU host; files land in $OUT (default ./gpu-out).
#
#   bash tests/gpu/proof/run.sh c1                 # volume 1 (carry .stage/c1); exit 2 expected
#   bash tests/gpu/proof/run.sh c2 [BUDGET_S]      # volume 2 + plugin wheels (carry .stage/c2,
#                                                  # .stage/plugin); item 1 full scale; GPU tests
#   bash tests/gpu/proof/run.sh bench BUDGET_S NAME...   # item 2 workloads, warm host:
#                                                  # chat, sharegpt, pressure (REPEAT_<name> overrides)
#   bash tests/gpu/proof/run.sh serve BUDGET_S     # tests/gpu/test_serve_gpu.py
#
# BUDGET_S: seconds the whole step may take (each sub-run gets what is left, via timeout).
set -uo pipefail
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
STEP=${1:?step}; shift
BUDGET=${1:-570}; [ $# -gt 0 ] && shift
MODEL=/tmp/vllm-kit/dummy-llama
LOG="$OUT/call-$STEP.txt"

left() { echo $(( BUDGET - SECONDS )); }
facts() {
  echo "== step $STEP, $(date -u +%FT%TZ)"
  # The device copy of the tree carries no git history (HEAD is unborn there): name the code
  # by a hash of proxima/ + tests/gpu/ (*.py) + pyproject.toml, to compare with a local commit.
  echo "HEAD $(git rev-parse --verify -q HEAD || echo 'n/a (no git history in this copy)')"
  echo "code hash $( (find proxima tests/gpu pyproject.toml -type f -name '*.py' -o -name pyproject.toml \
    | LC_ALL=C sort | xargs sha256sum | sha256sum) | cut -c1-64)"
  echo "git status --short (start):"; git status --short; echo "(end of status)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}
use_site() {
  export PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
}
# timed NAME LIMIT CMD...: run CMD with a time limit, its output into $OUT/NAME.log
timed() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 30 ]; then echo "[$name] SKIPPED: only ${limit}s left" | tee -a "$LOG"; return 99; fi
  local t=$SECONDS
  echo "[$name] start (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "[$name] rc=$rc wall=$((SECONDS - t))s" | tee -a "$LOG"
  return $rc
}
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timed "$name" "$(( $(left) - 5 ))" python3 -m proxima.cli bench --offline --model "$MODEL" \
    --load-format dummy --no-progress --json "$OUT/$name.json" "$@"
}

facts 2>&1 | tee "$LOG"
case "$STEP" in
  c1)
    bash .stage/c1/kit/install-on-device.sh .stage 2>&1 | tee -a "$LOG"
    echo "installer rc=${PIPESTATUS[0]} (2 expected: volume 2 to come)" | tee -a "$LOG"
    git log --oneline -1 | tee -a "$LOG" ;;
  c2)
    bash .stage/c2/kit/install-on-device.sh .stage 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; echo "installer rc=$rc" | tee -a "$LOG"; [ "$rc" = 0 ] || exit "$rc"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/plugin/*.whl 2>&1 | tee -a "$LOG"
    use_site
    python3 -m proxima.cli bench --help > /dev/null 2>&1 || echo "WARNING: proxima bench --help failed" | tee -a "$LOG"
    # item 1, full scale: greedy, 400 multi-turn requests (shared prefixes), KV 30,720 tokens
    bench identity --workload multiturn --requests 400 --kv-cache-memory-bytes 4026531840 --check-outputs
    # items 1 and 2 at a small scale: the gpu-marked tests
    timed gpu-tests "$(( $(left) - 5 ))" python3 -m pytest -o addopts="" -m gpu \
      tests/gpu/test_bench_offline_gpu.py -x -q -p no:cacheprovider ;;
  bench)
    bash /tmp/vllm-kit/install-on-device.sh .stage 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; echo "installer rc=$rc" | tee -a "$LOG"; [ "$rc" = 0 ] || exit "$rc"
    use_site
    for name in "$@"; do
      case "$name" in
        chat)     bench chat --workload chat --repeat "${REPEAT_chat:-3}" --check-outputs --plot "$OUT/chat.png" ;;
        sharegpt) bench sharegpt --workload sharegpt --repeat "${REPEAT_sharegpt:-2}" --plot "$OUT/sharegpt.png" ;;
        pressure) bench pressure --workload pressure --kv-cache-memory-bytes 4026531840 \
                    --repeat "${REPEAT_pressure:-2}" --check-outputs --plot "$OUT/pressure.png" ;;
        *) echo "unknown workload $name" | tee -a "$LOG" ;;
      esac
    done ;;
  serve)
    bash /tmp/vllm-kit/install-on-device.sh .stage 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; echo "installer rc=$rc" | tee -a "$LOG"; [ "$rc" = 0 ] || exit "$rc"
    use_site
    timed serve-tests "$(( $(left) - 5 ))" python3 -m pytest -o addopts="" -m gpu \
      tests/gpu/test_serve_gpu.py -x -q -p no:cacheprovider ;;
  *) echo "unknown step $STEP"; exit 64 ;;
esac
echo "== step $STEP done after ${SECONDS}s; git status --short (end):" | tee -a "$LOG"
git status --short 2>&1 | tee -a "$LOG"
