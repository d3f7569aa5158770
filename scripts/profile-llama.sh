#!/usr/bin/env bash
# Where one fine-tuning step of the 106M Llama spends its CPU time, accel zero3 beside
# PyTorch FSDP2 on 2 processes (the setting of `cargo xtask bench llama`), from Linux perf.
#
#     cargo xtask bench llama            # once: the model, the tokens, the release binaries
#     bash scripts/profile-llama.sh [SHORT LONG]
#     LEN=1024 bash scripts/profile-llama.sh 1 3     # rows of 1024 tokens instead of 128
#     ROW=lora bash scripts/profile-llama.sh         # accel DDP + LoRA r8 beside peft's
#     OWN_ALLOCATOR=1 ROW=zero3-ac LEN=1024 bash scripts/profile-llama.sh 1 3
#                                # with activation checkpointing, each side's own allocator
#
# Each side runs twice under `perf record -g` (SHORT and LONG steps, 2 and 6 by default);
# python/reference/perf_where.py puts every sample in a category (page faults, matrix
# products, copies, the interpreter, ...) and subtracts the short run from the long one, so
# start-up and loading cancel: CPU seconds per step, both processes together. The inputs,
# the malloc setting and ROW: scripts/llama-rows.sh. Needs perf (Debian's linux-perf) and permission
# to profile (root, or kernel.perf_event_paranoid <= 1).
set -euo pipefail
cd "$(dirname "$0")/.."
short=${1:-2} long=${2:-6}
[ "$long" -gt "$short" ] || { echo "LONG ($long) must exceed SHORT ($short)"; exit 1; }
command -v perf >/dev/null || { echo "perf is not installed: apt-get install linux-perf"; exit 1; }
source scripts/llama-rows.sh
export OMP_NUM_THREADS=1
py=.venv/bin/python out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The command of each side, its step count last.
ours=(target/release/accel launch --num-processes 2 --main-process-port 0 --cpu
  target/release/examples/llama --model "$model" --data "$data" --batch-size 2 --lr 1e-4
  --strategy "$strategy" ${extra[@]+"${extra[@]}"} --out "$dir/out" --steps)
theirs=(.venv/bin/torchrun --nproc-per-node=2 --master-port=29794
  python/reference/llama_reference.py memory --model "$model" --data "$data" --batch-size 2
  ${theirs_extra[@]+"${theirs_extra[@]}"} --steps)
for side in ours theirs; do
  unset -n cmd; declare -n cmd=$side
  for steps in "$short" "$long"; do
    perf record -q -g -F 499 -o "$out/$side-$steps.data" -- "${cmd[@]}" "$steps" \
      >"$out/$side-$steps.log" 2>&1 || { cat "$out/$side-$steps.log"; exit 1; }
    perf script -i "$out/$side-$steps.data" -F comm,pid,ip,sym,dso 2>/dev/null > "$out/$side-$steps.txt"
  done
  "$py" python/reference/perf_where.py --minus "$out/$side-$short.txt" \
    --steps $(( long - short )) < "$out/$side-$long.txt" > "$out/$side.json"
done
"$py" - "$out/ours.json" "$out/theirs.json" "${names[@]}" <<'TABLE'
import json, sys
ours, theirs = (json.load(open(f)) for f in sys.argv[1:3])
w = max(12, *map(len, sys.argv[3:5]))
print("CPU seconds per step, both processes together (perf, 499 Hz)")
print(f"{'':54} {sys.argv[3]:>{w}} {sys.argv[4]:>{w}}")
for k in sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, 0), theirs.get(k, 0))):
    print(f"{k:54} {ours.get(k, 0) / 499:>{w}.2f} {theirs.get(k, 0) / 499:>{w}.2f}")
print(f"{'total':54} {sum(ours.values()) / 499:>{w}.2f} {sum(theirs.values()) / 499:>{w}.2f}")
TABLE
for side in ours theirs; do
  echo "$side, seconds per step (${long}-step run, each process): $(grep -ho '"step_s": *[0-9.]*' "$out/$side-$long.log" | sed 's/.*: *//' | tr '\n' ' ')"
done
