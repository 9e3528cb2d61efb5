#!/usr/bin/env bash
# Issues 4 and 5 on the lent H200s: the driver of the recorded GPU runs (docs/results/).
# Run from the repo root on the GPU host; files land in $OUT (default ./gpu-out).
#
# Staging (on a networked CPU machine, from the repo root, into the git-ignored .stage/;
# about 1.5 GB of downloads in /tmp/vllm-stage, some minutes of xz):
#   bash tools/gpu/stage-vllm.sh    # .stage/c1, c2: vLLM 0.26.0; .stage/plugin: Proxima's wheel
#                                   # (its plugin entry point); .stage/serve-extra: serve's wheels
# It prints the calls below with what each carries, and fails if one would not fit the 64 MiB
# a device call carries with the tree.
#
#   bash tools/gpu/run.sh c1                    # volume 1 + wheels (carry .stage/c1,
#                                               # .stage/plugin, .stage/serve-extra); installer rc=2
#   bash tools/gpu/run.sh c2 BUDGET_S LANE...   # volume 2 (carry .stage/c2), then the lanes
#   bash tools/gpu/run.sh run BUDGET_S LANE...  # later calls on the warm host
#   bash tools/gpu/run.sh pack                  # one tgz of all under $OUT if more than 8 files
#                                               # (a call brings 8 back): after several runs
#                                               # into OUT=$OUT/NAME folders in one call
# (cN for each volume N: the call that brings the last one runs the lanes.)
#
# LANE is "GPUS:TASK,TASK,...", e.g. "0:identity,gpu-tests" "1:serve-tests" or "0,1:tp2".
# Lanes run side by side (one per GPU set), their tasks one after the other, each task on
# CUDA_VISIBLE_DEVICES=GPUS with its own torch.compile cache (VLLM_CACHE_ROOT per GPU set).
# Tasks:
#   identity     item 1: greedy, 400 multi-turn requests (shared prefixes), KV 30,720 tokens
#                (forces preemption), --check-outputs, --repeat ${REPEAT_identity:-2}
#   chat, sharegpt, pressure   item 2 workloads (REPEAT_<name> overrides the repeat count)
#   tp2          item 3: item 1 with tensor_parallel_size=2 (200 requests; needs 2 GPUs)
#   online-default, online-pressure   item 2 the article's way (online, OpenAI API, streaming):
#                two vLLM servers on the lane's GPU, stock (PROXIMA_ALLOCATOR=0) and Proxima (=1),
#                started one after the other, then `proxima bench` loads them in turn:
#                default KV: chat (concurrency 20) x ${REPEAT_online_chat:-5} rounds, sharegpt x ${REPEAT_online_sharegpt:-2};
#                30,720-token KV: pressure x ${REPEAT_online_pressure:-3}
#   (offline tasks hold arrivals, bench's default; ARRIVALS=as-sent as before 2026-11-30 s3)
#   elastic-proof  issue 13 driver A (tools/gpu/elastic_proof.py): (a) identity through
#                forced cycles, (b) release after a burst / another process takes it / regrow,
#                (d) steady-load throughput; ~6 min; files elastic_proof.{json,log,-logs.tgz}
#   elastic-proof-tp2  issue 38: elastic-proof with tensor_parallel_size=2 on the lane's two
#                GPUs (mp executor; (b)'s taker takes the memory back on each GPU), e.g.
#                "0,1:elastic-proof-tp2"; files in $OUT/elastic-proof-tp2/ (apart from
#                elastic-proof's, same names); EP_ONLY as for elastic-proof
#   two-engines  issue 13 driver B (tools/gpu/two_engines.py): (c) two engines on one GPU,
#                alternating bursts, elastic vs a static 0.45/0.45 split; ~7 min (the driver
#                itself takes --engines N for N servers, bursts in turn: run it directly)
#                (COMPACTOR=module:factory passes issue 14's compaction to the elastic servers)
#                (TE_ARGS: more of its options, e.g. "--user-path --prompt 4000 --requests 160")
#   gpu-tests    tests/gpu/test_bench_offline_gpu.py (items 1 and 2 at a small scale)
#   serve-tests  tests/gpu/test_serve_gpu.py (issue 5)
#   serve-multi-tests  tests/gpu/test_serve_multi_gpu.py (issue 36: two models, one endpoint;
#                then one sleep/wake cycle of a --sleep-after model: $OUT/sleep_wake.{json,log};
#                PROXIMA_SLEEP_MODEL=$PWD/tools/gpu/dummy-llama for 8B-sized weights;
#                PYTEST_K=sleeps runs the sleep/wake test alone)
#   three-models issue 36 (tools/gpu/three_models.py): three models behind one `proxima serve`
#                against three stock servers; TM_BUDGET seconds (default: all left), TM_ARGS more
#   compaction-proof   issue 14's driver (tools/gpu/compaction_proof.py): identity under off,
#                every:2, every:5, auto, then throughput auto vs off; files compaction_proof.{json,log}
# BUDGET_S: seconds the whole step may take (each task gets what is left, via timeout).
# At the end, if $OUT holds more than 8 files (the most one device call brings back), all but
# the step's own log are packed into $OUT/results-STEP.tgz (call 2 of session 3 lost files so).
set -uo pipefail
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
STEP=${1:?step}; shift
BUDGET=${1:-570}; [ $# -gt 0 ] && shift
STAGE=${STAGE:-.stage}   # what stage-vllm.sh wrote, as carried
SITE=${VLLM_SITE:-/tmp/site}   # where install-on-device.sh puts vLLM (it reads VLLM_SITE too)
MODEL=$PWD/tools/gpu/dummy-llama   # Llama-3.1-8B's shape, weights random (load_format=dummy)
LOG="$OUT/call-$STEP.txt"
KV_30K=4026531840        # 30,720 tokens of Llama-3.1-8B's KV (131,072 bytes per token)
KV_30K_TP2=2013265920    # the same 30,720 tokens with the KV heads split over 2 GPUs

left() { echo $(( BUDGET - SECONDS )); }
facts() {
  echo "== step $STEP, $(date -u +%FT%TZ), lanes: $*"
  # The device copy of the tree carries no git history (HEAD is unborn there): name the code
  # by a hash of proxima/ + tests/gpu/ + tools/gpu/ (*.py) + pyproject.toml, to compare with a
  # local commit.
  echo "code hash $( (find proxima tests/gpu tools/gpu pyproject.toml -type f -name '*.py' -o -name pyproject.toml \
    | LC_ALL=C sort | xargs sha256sum | sha256sum) | cut -c1-64)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
  echo "cores $(nproc)"
}
use_site() {
  export PYTHONPATH=$PWD:$SITE VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
  # NVLink multicast stays off on the shared multi-GPU hosts (KINDS.md).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}
install_wheels() {   # the Proxima wheel (entry point only), serve's wheels
  local d
  for d in "$STAGE/plugin" "$STAGE/serve-extra"; do
    [ -d "$d" ] || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$d"/*.whl 2>&1 \
      | grep -v "already exists" | tee -a "$LOG"
    echo "wheels from $d installed into $SITE" | tee -a "$LOG"
  done
}
# timed NAME LIMIT CMD...: run CMD with a time limit, its output into $OUT/NAME.log
timed() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 30 ]; then echo "[$name] SKIPPED: only ${limit}s left" | tee -a "$LOG"; return 99; fi
  local t=$SECONDS
  echo "[$name] start $(date -u +%T) on GPU ${CUDA_VISIBLE_DEVICES:-all} (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc wall=$((SECONDS - t))s end $(date -u +%T)" | tee -a "$LOG"
  tail -n 25 "$OUT/$name.log" | sed "s/^/[$name] /" >> "$LOG"
  return $rc
}
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timed "$name" "$(( $(left) - 5 ))" python3 -m proxima.cli bench --offline --model "$MODEL" \
    --load-format dummy --no-progress --arrivals "${ARRIVALS:-held}" --json "$OUT/$name.json" "$@"
}
# server NAME PORT ALLOCATOR KV_BYTES: a vLLM OpenAI server in the background, its pid in $NAME.pid
server() {
  local name=$1 port=$2 alloc=$3 kv=$4
  echo "[$name] start $(date -u +%T) on GPU $CUDA_VISIBLE_DEVICES: PROXIMA_ALLOCATOR=$alloc port $port kv $kv" | tee -a "$LOG"
  PROXIMA_ALLOCATOR=$alloc python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --load-format dummy --tokenizer "$PWD/proxima/models/tiny-llama" --port "$port" \
    --gpu-memory-utilization 0.45 --kv-cache-memory-bytes "$kv" > "$OUT/$name.log" 2>&1 &
  echo $! > "$OUT/$name.pid"
}
# healthy PORT LIMIT: wait until /health answers 200
healthy() {
  python3 - "$1" "$2" <<'PYEOF'
import sys, time, urllib.request
port, limit = sys.argv[1], float(sys.argv[2]); end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(2)
sys.exit(1)
PYEOF
}
online() {  # online NAME KV_BYTES WORKLOAD:REPEAT...
  local name=$1 kv=$2; shift 2
  local base=$(( 8100 + 10 * ${CUDA_VISIBLE_DEVICES%%,*} )) t=$SECONDS w
  server "$name-stock" $base 0 "$kv"
  if healthy $base "$(( $(left) - 60 ))"; then
    server "$name-proxima" $(( base + 1 )) 1 "$kv"
    if healthy $(( base + 1 )) "$(( $(left) - 30 ))"; then
      echo "[$name] both servers healthy after $((SECONDS - t))s" | tee -a "$LOG"
      grep -h "Using Proxima contiguous allocator" "$OUT/$name-proxima.log" | tail -n 1 | tee -a "$LOG"
      for w in "$@"; do
        timed "$name-${w%%:*}" "$(( $(left) - 10 ))" python3 -m proxima.cli bench \
          --base-url http://127.0.0.1:$base --label stock \
          --base-url http://127.0.0.1:$(( base + 1 )) --label proxima --model "$MODEL" \
          --workload "${w%%:*}" --repeat "${w#*:}" --no-progress \
          --json "$OUT/$name-${w%%:*}.json" --plot "$OUT/$name-${w%%:*}.png"
      done
    else echo "[$name] proxima server not healthy" | tee -a "$LOG"; fi
  else echo "[$name] stock server not healthy" | tee -a "$LOG"; fi
  kill "$(cat "$OUT/$name-stock.pid")" "$(cat "$OUT/$name-proxima.pid" 2>/dev/null)" 2>/dev/null
  wait 2>/dev/null
}
task() {
  case "$1" in
    identity) bench identity --workload multiturn --requests 400 --kv-cache-memory-bytes $KV_30K \
                --check-outputs --repeat "${REPEAT_identity:-2}" ;;
    chat)     bench chat --workload chat --repeat "${REPEAT_chat:-3}" --check-outputs --plot "$OUT/chat.png" ;;
    sharegpt) bench sharegpt --workload sharegpt --repeat "${REPEAT_sharegpt:-2}" --plot "$OUT/sharegpt.png" ;;
    pressure) bench pressure --workload pressure --kv-cache-memory-bytes $KV_30K \
                --repeat "${REPEAT_pressure:-2}" --check-outputs --plot "$OUT/pressure.png" ;;
    tp2)      bench tp2 --workload multiturn --requests 200 --tensor-parallel-size 2 \
                --kv-cache-memory-bytes $KV_30K_TP2 --check-outputs ;;
    online-default)  online online-default 40000000000 "chat:${REPEAT_online_chat:-5}" \
                       "sharegpt:${REPEAT_online_sharegpt:-2}" ;;
    online-pressure) online online-pressure $KV_30K "pressure:${REPEAT_online_pressure:-3}" ;;
    elastic-proof) timed elastic-proof "$(( $(left) - 5 ))" python3 tools/gpu/elastic_proof.py ${EP_ONLY:+--only "$EP_ONLY"} \
                     --out "$OUT" --budget "$(( $(left) - 25 ))" ;;
    elastic-proof-tp2) timed elastic-proof-tp2 "$(( $(left) - 5 ))" python3 tools/gpu/elastic_proof.py --tp 2 \
                     ${EP_ONLY:+--only "$EP_ONLY"} --out "$OUT/elastic-proof-tp2" --budget "$(( $(left) - 25 ))" ;;
    two-engines)   timed two-engines "$(( $(left) - 5 ))" python3 tools/gpu/two_engines.py \
                     --out "$OUT" --budget "$(( $(left) - 25 ))" ${COMPACTOR:+--compactor "$COMPACTOR"} ${TE_ARGS:-} ;;
    gpu-tests)   timed gpu-tests "$(( $(left) - 5 ))" python3 -m pytest -o addopts="" -m gpu \
                   tests/gpu/test_bench_offline_gpu.py -q -p no:cacheprovider -rA ;;
    serve-tests) timed serve-tests "$(( $(left) - 5 ))" python3 -m pytest -o addopts="" -m gpu \
                   tests/gpu/test_serve_gpu.py -x -q -p no:cacheprovider -rA ;;
    serve-multi-tests) timed serve-multi-tests "$(( $(left) - 5 ))" python3 -m pytest -o addopts="" \
                   -m gpu tests/gpu/test_serve_multi_gpu.py -q -p no:cacheprovider -rA ${PYTEST_K:+-k "$PYTEST_K"} ;;
    three-models) timed three-models "$(( $(left) - 5 ))" python3 tools/gpu/three_models.py \
                     --out "$OUT" --budget "${TM_BUDGET:-$(( $(left) - 25 ))}" ${TM_ARGS:-} ;;
    compaction-proof) timed compaction-proof "$(( $(left) - 5 ))" python3 tools/gpu/compaction_proof.py \
                     --out "$OUT" --budget "$(( $(left) - 25 ))" ;;
    *) echo "unknown task $1" | tee -a "$LOG" ;;
  esac
}
lane() {  # lane "GPUS:TASK,TASK"
  local gpus=${1%%:*} tasks=${1#*:} t
  export CUDA_VISIBLE_DEVICES=$gpus VLLM_CACHE_ROOT=/root/.cache/vllm-gpu${gpus//,/-}
  # vLLM picks its torch.distributed port as "a free one": lanes side by side raced for the
  # same port (EADDRINUSE), so each GPU set searches from its own base.
  export VLLM_PORT=$(( 20000 + 2000 * ${gpus%%,*} + 1000 * (${#gpus} > 1) ))
  for t in ${tasks//,/ }; do task "$t"; done
}
lanes() {
  local l pids=()
  for l in "$@"; do lane "$l" & pids+=($!); done
  for l in "${pids[@]}"; do wait "$l"; done
}
READY=$SITE/.proxima-checked   # written by the call whose checks all passed on this machine
check_install() {  # install the volumes carried (if any), check vLLM, then what serve needs
  # A later `run` call on the warm machine: the checks passed already (they took ~55 s of
  # each such call in session 30), so none again.
  if [ "$STEP" = run ] && [ -f "$READY" ]; then
    echo "install checked by an earlier call on this machine ($(cat "$READY")): not again" \
      | tee -a "$LOG"
    use_site; return 0
  fi
  bash tools/gpu/install-on-device.sh "$STAGE" "$SITE" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 2 ]; then   # volumes still to come: the wheels now, the lanes in a later call
    echo "installer rc=2 (volumes still to come)" | tee -a "$LOG"; install_wheels; return 2
  fi
  echo "installer rc=$rc" | tee -a "$LOG"; [ "$rc" = 0 ] || exit "$rc"
  install_wheels
  use_site
  python3 -c "import torch; print('torch sees', torch.cuda.device_count(), 'GPUs')" 2>&1 | tee -a "$LOG"
  # what proxima serve needs on top of the offline kit: say so now, not deep inside a test
  local said
  said=$(python3 -c "import gunicorn, uvicorn_worker, vllm.entrypoints.openai.api_server, proxima.serve.app; \
print('serve imports ok')" 2>&1 | tail -n 3)
  echo "$said" | tee -a "$LOG"
  [ "$said" = "serve imports ok" ] && echo "step $STEP at $(date -u +%T)" > "$READY"
  return 0
}

# What the GPUs ran at while the lanes ran: every 2 s into $OUT/gpu-clocks.csv, one line per
# GPU into the call's log at the end (tools/gpu/gpu_clocks.py says why).
clocks_start() {
  local fields; fields=$(python3 -c "import sys; sys.path.insert(0, 'tools/gpu'); import gpu_clocks; print(gpu_clocks.FIELDS)")
  nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -c 1 > /dev/null 2>&1 \
    || fields=${fields%,*}   # a driver that does not know the reasons' field: the rest
  nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -l 2 > "$OUT/gpu-clocks.csv" 2> /dev/null &
  CLOCKS=$!
}
clocks_stop() {
  kill "$CLOCKS" 2> /dev/null; wait "$CLOCKS" 2> /dev/null
  python3 tools/gpu/gpu_clocks.py "$OUT/gpu-clocks.csv" 2>&1 | tee -a "$LOG"
}

pack_out() {   # every file under $OUT, folders too (session 30 lost 4 files of a folder)
  local n; n=$(find "$OUT" -type f | wc -l)
  [ "$n" -le 8 ] && return 0
  (cd "$OUT" && find . -type f ! -path "./call-$STEP.txt" ! -path "./results-$STEP.tgz" ! -path ./.packed -printf '%P\n' \
     | LC_ALL=C sort > .packed && tar czf "results-$STEP.tgz" -T .packed && xargs rm -f < .packed \
     && rm -f .packed && find . -mindepth 1 -type d -empty -delete) \
    && echo "packed $((n - 1)) files into $OUT/results-$STEP.tgz" | tee -a "$LOG"
}

facts "$@" 2>&1 | tee "$LOG"
case "$STEP" in
  c[0-9]*|run)
    check_install && { clocks_start; lanes "$@"; clocks_stop; } ;;
  pack) ;;   # only pack_out below: after several OUT=$OUT/sub runs in one call
  *) echo "run.sh: unknown step '$STEP' (c1, c2, ... for the call that brings that volume, run, or pack)" \
       | tee -a "$LOG"; exit 64 ;;
esac
echo "== step $STEP done after ${SECONDS}s" | tee -a "$LOG"
pack_out
