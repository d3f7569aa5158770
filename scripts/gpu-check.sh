#!/usr/bin/env bash
# Every CUDA-side check at once, for a machine with 1+ NVIDIA GPUs and torch 2.11.0 (+cu130)
# in its python3. It stops at the first failure and ends with a summary: what passed, what
# failed, what was skipped and why, and the figures measured beside PyTorch.
#
# The binaries and fixtures come from this repository's development machine:
#     bash scripts/gpu-check-prepare.sh      # release build, stripped, into target/gpu-check
# then, on the GPU machine, from the repository root:
#     bash scripts/gpu-check.sh [target/gpu-check]
#
# `--cpu-dry-run` runs every step with CPU devices where CUDA would be used (and small sizes),
# states each NCCL-only step as skipped, and checks nothing about GPUs: it exercises the
# script itself (paths, flags, the parsing of figures, the summary), which the test suite does
# on every commit (`gpu_check_runs_end_to_end_as_a_cpu_dry_run`). PYTHON names the Python with
# torch 2.11.0 (default python3). Every step has a time budget (STEP_BUDGET seconds, 150 by
# default) and prints its time; the whole one-GPU run is sized to stay under 6 minutes.
#
# One GPU runs: the CUDA unit tests, the main job in bf16 and fp16, the NCCL self-check,
# every strategy at world size 1 through the real NCCL communicator (ACCEL_GROUP_OF_ONE)
# against the CPU run on the same weights and data, step time and peak memory per strategy
# beside PyTorch, fp8 and bf16 speed beside PyTorch (+ Accelerate where installed). Two or
# more GPUs add: every strategy and hybrid sharding across the GPUs against CPU DDP, the
# all-reduce bandwidth beside torch's NCCL, and a kill -9 of one rank. NCCL refuses two ranks
# on one GPU, so those print "skipped: needs 2+ GPUs" on a machine with one.
set -u -o pipefail
dry=0
if [ "${1:-}" = --cpu-dry-run ]; then dry=1; shift; fi
dir=${1:-target/gpu-check}
bin=$dir/bin
out=$(mktemp -d /tmp/accel-gpu-check.XXXXXX)
python=${PYTHON:-python3}
budget=${STEP_BUDGET:-150}
torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') || {
  echo "$python cannot import torch: this script needs torch 2.11.0 (set PYTHON)"; exit 1; }
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -z "${NCCL_LIBRARY:-}" ]; then
  nccl=$("$python" -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$nccl" ] && export NCCL_LIBRARY=$nccl
fi
if [ "$dry" = 1 ]; then
  # One pretend device, and it is the CPU.
  gpus=1 dev=cpu cpu_flag=(--cpu)
else
  # Whole GPUs only: under MIG, `nvidia-smi -L` also lists each instance ("  MIG ...").
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  dev=cuda cpu_flag=()
fi
launch() { "$bin/accel" launch --main-process-port 0 --timeout 120 "$@"; }

# The summary is a file: steps run in subshells (for their time budget) add figures to it.
summary=$out/summary
: > "$summary"
finish() {
  echo
  if [ "$dry" = 1 ]; then
    echo "== summary (CPU dry run: nothing ran on a GPU; outputs in $out)"
  else
    echo "== summary ($gpus GPU(s); outputs in $out)"
  fi
  cat "$summary"
}
trap finish EXIT
# check NAME COMMAND...: runs it within the step budget; a failure ends the script.
check() {
  local name=$1 start=$SECONDS
  shift
  echo
  echo "== $name"
  local state
  state=$(declare -f; declare -p bin out dir python dev gpus dry W D cpu_flag summary comm 2>/dev/null)
  if timeout --foreground "$budget" bash -c "$state; \"\$@\"" step "$@"; then
    echo "PASS  $name ($(( SECONDS - start )) s)" >> "$summary"
    echo "   ($(( SECONDS - start )) s)"
  else
    local code=$?
    [ "$code" = 124 ] && name="$name: over its budget of $budget s"
    echo "FAIL  $name ($(( SECONDS - start )) s)" >> "$summary"
    exit 1
  fi
}
# nccl_only NAME COMMAND...: a step that only NCCL can run; skipped in a dry run.
nccl_only() {
  if [ "$dry" = 1 ]; then skip "$1" "NCCL only (CPU dry run)"; else check "$@"; fi
}
skip() { echo; echo "== $1: skipped: $2"; echo "skip  $1: skipped: $2" >> "$summary"; }
figure() { echo "      $*" >> "$summary"; echo "   -> $*"; }
value() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" | tail -n 1; }

W=$dir/W.safetensors D=$dir/D.safetensors
parity() {  # parity NAME [accel launch flags...] -- [parity flags...]
  local name=$1 flags=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  launch "${flags[@]}" "$bin/parity" --init "$W" --data "$D" --hidden 16,16 --epochs 3 \
    --batch-size 4 --accumulate 2 --clip-grad-norm 1.0 --out "$out/$name.safetensors" \
    --losses "$out/$name.jsonl" "$@"
}
same() { "$bin/accel" compare-weights "$out/$1.safetensors" "$out/$2.safetensors" --tolerance 1e-4; }

if [ "$dry" = 1 ]; then comm="the CPU communicator"; else comm=NCCL; fi
check "accel env" "$bin/accel" env
[ "$gpus" -ge 1 ] || { echo "no GPU visible (nvidia-smi -L)"; exit 1; }
if [ -x "$bin/accel_core_tests" ]; then
  check "cargo test cases for CUDA (accel-core's unit tests named cuda)" \
    "$bin/accel_core_tests" cuda --test-threads 1
else
  skip "cargo test cases for CUDA" "no $bin/accel_core_tests"
fi
check "the main job on $dev:0 in bf16" \
  "$bin/train" "${cpu_flag[@]}" --precision bf16 --epochs 10 --out "$out/train-bf16"
check "the main job on $dev:0 in fp16" \
  "$bin/train" "${cpu_flag[@]}" --precision fp16 --epochs 10 --out "$out/train-fp16"
nccl_only "NCCL self-check on $gpus GPU(s): every collective's values" \
  launch --num-processes "$gpus" "$bin/accel" worker nccl

# Every strategy through the real NCCL communicator at world size 1, against the CPU run.
at_one() {
  ACCEL_GROUP_OF_ONE=1 parity "gpu1-$1" --num-processes 1 -- --device "$dev" --strategy "$1" &&
    same "gpu1-$1" cpu-1
}
across() {
  parity "gpu$gpus-$1" --num-processes "$gpus" -- --device "$dev" --strategy "$1" &&
    same "gpu$gpus-$1" "cpu-$gpus"
}
check "parity on CPU, one process (the reference)" parity cpu-1 --num-processes 1 --cpu --
for s in ddp zero1 zero2 zero3; do
  check "$s at world size 1 through $comm on $dev:0 = CPU (1e-4)" at_one "$s"
done
# FSDP's MixedPrecision(param_dtype): zero3 units gathered and computed in bf16.
bf16_parameters() {
  ACCEL_GROUP_OF_ONE=1 parity gpu1-ddp-bf16 --num-processes 1 -- --device "$dev" --strategy ddp \
    --precision bf16 &&
    ACCEL_GROUP_OF_ONE=1 parity gpu1-zero3-bf16-params --num-processes 1 -- --device "$dev" \
      --strategy zero3 --precision bf16 --bf16-parameters &&
    "$bin/accel" compare-weights "$out/gpu1-ddp-bf16.safetensors" \
      "$out/gpu1-zero3-bf16-params.safetensors" --tolerance 1e-2
}
check "zero3 with bf16 parameters on $dev:0 near bf16 DDP (1e-2)" bf16_parameters

# Big-model inference: a small Llama generating by a device map that puts the embedding and
# its first layer on the GPU, the other layers in main memory (brought to the GPU as each
# runs) and the norm and head on the disk; its greedy tokens equal the whole model's on the
# CPU. (A dry run maps "cpu" where the GPU would be.)
generate_by_map() {
  local gpu=0
  [ "$dry" = 1 ] && gpu='"cpu"'
  local args=(generate --model "$dir/llama-small" --prompt-ids 1,5,9,13 --max-new-tokens 8)
  local map="{\"model.embed_tokens\": $gpu, \"model.layers.0\": $gpu, \"model.layers\": \"cpu\",
    \"model.norm\": \"disk\", \"model.rotary_emb\": \"disk\", \"lm_head\": \"disk\"}"
  local whole mapped
  whole=$("$bin/llama" "${args[@]}" 2>"$out/generate-whole.log") || { cat "$out/generate-whole.log"; return 1; }
  mapped=$("$bin/llama" "${args[@]}" --device-map "$map" --offload-folder "$out/offload" \
    2>"$out/generate-map.log") || { cat "$out/generate-map.log"; return 1; }
  echo "whole on the CPU: $whole"
  echo "by the map:       $mapped"
  [ -n "$whole" ] && [ "$whole" = "$mapped" ]
}
if [ -x "$bin/llama" ] && [ -f "$dir/llama-small/config.json" ]; then
  check "generation by a device map over $dev:0, the CPU and the disk = the whole model" \
    generate_by_map
else
  skip "generation by a device map" "no $bin/llama or $dir/llama-small"
fi

if [ "$gpus" -ge 2 ]; then
  check "parity on CPU, DDP on $gpus processes (the reference)" \
    parity "cpu-$gpus" --num-processes "$gpus" --cpu --
  for s in ddp zero1 zero2 zero3; do
    check "$s on $gpus GPUs over NCCL = CPU DDP (1e-4)" across "$s"
  done
  half=$(( gpus / 2 ))
  hybrid() {
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    local common=(--num-machines 2 --main-process-ip 127.0.0.1 --main-process-port "$port"
      --timeout 120 --strategy hybrid_shard "$bin/parity" --init "$W" --data "$D" --hidden 16,16
      --epochs 3 --batch-size 4 --accumulate 2 --clip-grad-norm 1.0 --device cuda
      --out "$out/hybrid.safetensors" --losses "$out/hybrid.jsonl")
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( half - 1 ))) \
      "$bin/accel" launch --num-processes "$half" --machine-rank 0 "${common[@]}" &
    local first=$!
    CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $(( 2 * half - 1 ))) \
      "$bin/accel" launch --num-processes "$half" --machine-rank 1 "${common[@]}" || return 1
    wait "$first" || return 1
    [ "$(( 2 * half ))" -eq "$gpus" ] || { echo "odd GPU count: hybrid uses $(( 2 * half ))"; return 0; }
    same hybrid "cpu-$gpus"
  }
  check "hybrid sharding: 2 launchers x $half GPU(s) = CPU DDP (1e-4)" hybrid
  kill_one() {
    mkdir -p "$out/pids"
    ACCEL_PID_DIR=$out/pids launch --num-processes "$gpus" "$bin/accel" worker spin-nccl &
    local launcher=$! start
    sleep 10
    [ -f "$out/pids/1" ] || { echo "rank 1 never started"; return 1; }
    start=$SECONDS
    kill -9 "$(cat "$out/pids/1")"
    while kill -0 "$launcher" 2>/dev/null && [ $(( SECONDS - start )) -le 60 ]; do sleep 1; done
    local took=$(( SECONDS - start )) left=0
    for f in "$out"/pids/*; do kill -0 "$(cat "$f")" 2>/dev/null && left=$(( left + 1 )); done
    figure "kill -9 of rank 1 mid-collective: launch ended after ${took} s, $left process(es) left"
    [ "$took" -le 30 ] && [ "$left" -eq 0 ]
  }
  check "kill -9 of one GPU rank mid-collective ends the launch within 30 s, no survivors" kill_one
  # Context parallelism: attention's all-to-all over NCCL, each sequence split over 2 GPUs.
  check "char_lm split by context parallelism over 2 GPUs (all_to_all over NCCL)" \
    launch --num-processes 2 "$bin/char_lm" --context-parallel 2 --steps 100 --target 10
  check "all-reduce bus bandwidth beside torch's NCCL (target >= 0.95x)" \
    "$bin/accel" bench allreduce --num-processes "$gpus" --main-process-port 0 --backend nccl \
      --sizes 4MiB,64MiB,256MiB,1GiB --compare
else
  for what in "every strategy across GPUs against CPU DDP" "hybrid sharding" \
      "kill -9 of one GPU rank" "context parallelism over GPUs" \
      "all-reduce bandwidth beside torch's NCCL"; do
    skip "$what" "needs 2+ GPUs"
  done
fi

# Step time and peak GPU memory per strategy, accel beside PyTorch on the same model (8
# Linear 2560x2560 units, 52.4M parameters, AdamW, fp32; DDP / ZeRO-1 / FSDP2).
memory() {
  local s=$1 ours theirs prefix=(env) device_arg=()
  [ "$gpus" -eq 1 ] && prefix+=(ACCEL_GROUP_OF_ONE=1)
  [ "$dev" = cuda ] && device_arg=(cuda)
  ours=$("${prefix[@]}" "$bin/accel" launch --num-processes "$gpus" --main-process-port 0 \
    "${cpu_flag[@]}" --strategy "$s" "$bin/memory_bench" --device "$dev") || return 1
  theirs=$("$python" -m torch.distributed.run --nproc-per-node "$gpus" \
    python/reference/torch_memory.py "$s" "${device_arg[@]}") || return 1
  local line
  line=$("$python" - "$s" "$gpus" "$ours" "$theirs" <<'EOF'
import json, re, sys
s, n = sys.argv[1], int(sys.argv[2])
def rank0(text):
    for line in text.splitlines():
        m = re.search(r"\{.*\}", line)
        if m and json.loads(m.group(0)).get("rank") == 0:
            return json.loads(m.group(0))
    sys.exit(f"no result of rank 0 in:\n{text}")
ours, theirs = rank0(sys.argv[3]), rank0(sys.argv[4])
psi = ours["params"]
# The ZeRO paper's model state in fp32 with Adam: parameters 4, gradients 4, state 8 bytes
# per parameter, the sharded parts divided by N.
model_state = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n,
               "zero2": 4 * psi + 12 * psi / n, "zero3": 16 * psi / n}[s]
mib = lambda b: b / 2**20
# A CPU dry run has no GPU peak: the resident memory stands in for it.
peak = lambda r: r["gpu_peak_bytes"] if r.get("gpu_peak_bytes") is not None else r["peak_bytes"]
where = "GPU" if ours.get("gpu_peak_bytes") is not None else "CPU (dry run)"
print(f"{s} on {n} device(s): step {1e3 * ours['step_s']:.1f} ms vs torch {1e3 * theirs['step_s']:.1f} ms "
      f"({theirs['step_s'] / ours['step_s']:.2f}x); peak {where} {mib(peak(ours)):.0f} MiB vs torch "
      f"{mib(peak(theirs)):.0f} MiB; ZeRO model state {mib(model_state):.0f} MiB")
EOF
  ) || return 1
  figure "$line"
}
strategies=(ddp zero1 zero2 zero3)
[ "$dry" = 1 ] && strategies=(ddp zero3)
for s in "${strategies[@]}"; do
  check "$s: step time and peak memory beside PyTorch" memory "$s"
done

capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
lm() {  # lm PRECISION WIDTH HEADS BLOCKS CONTEXT BATCH: accel and the reference, one line
  local ours theirs
  ours=$("$bin/lm_bench" --device "$dev" --precision "$1" --width "$2" --heads "$3" --blocks "$4" \
    --context "$5" --batch "$6" --steps 20) || return 1
  theirs=$("$python" python/reference/accelerate_lm.py --device "$dev" --fused --precision "$1" \
    --width "$2" --heads "$3" --blocks "$4" --context "$5" --batch "$6" --steps 20) || return 1
  echo "$ours"; echo "$theirs"
  local a t
  a=$(echo "$ours" | value samples_per_s) t=$(echo "$theirs" | value samples_per_s)
  [ -n "$a" ] && [ -n "$t" ] || { echo "no samples_per_s in the output above"; return 1; }
  figure "GPT width $2, $1, 1 $dev: accel $a samples/s, $(echo "$theirs" | sed -n 's/.*reference=\([a-z]*\).*/\1/p') $t samples/s ($("$python" -c "print(f'{$a / $t:.2f}')")x)"
}
if [ "$dry" = 1 ]; then
  check "bf16 transformer beside PyTorch (dry run: a small one on the CPU)" lm bf16 64 4 2 32 4
else
  check "bf16 transformer on 1 GPU beside PyTorch (+ Accelerate where installed)" \
    lm bf16 512 8 6 256 16
fi
if [ "$dry" = 1 ]; then
  skip "fp8 on the GPU" "needs a GPU of compute capability 8.9 or more (CPU dry run)"
elif "$python" -c "import sys; sys.exit(0 if float('${capability:-0}') >= 8.9 else 1)"; then
  check "fp8 char_lm on cuda:0 (held-out loss printed)" \
    "$bin/char_lm" --precision fp8 --steps 200 --target 10
  for precision in bf16 fp8; do
    check "GPT width 2048 in $precision beside torchao" lm "$precision" 2048 16 4 512 8
  done
else
  skip "fp8 on the GPU" "compute capability ${capability:-unknown} < 8.9"
fi
