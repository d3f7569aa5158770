#!/usr/bin/env bash
# One row of `cargo xtask bench llama` beside its reference, in R alternating rounds of S
# steps each, with the spread and the ratio of the medians; with LIMIT=1 each round first
# runs what the compute allows: two 1-process runs at once (1 thread each, the same batch
# per process, nothing to communicate), accel's and PyTorch's.
#
#     cargo xtask bench llama                          # once: the model, tokens, binaries
#     ROW=zero3 LEN=1024 R=4 S=4 bash scripts/llama-rounds.sh    # zero3 beside FSDP2
#     ROW=lora R=6 S=6 LIMIT=1 bash scripts/llama-rounds.sh      # DDP + LoRA r8 beside peft
#     OWN_ALLOCATOR=1 ROW=zero3-ac LEN=1024 R=4 S=4 bash scripts/llama-rounds.sh
#
# The bench's setting: 2 processes (N=4 for 4), batch 2 rows, AdamW at 1e-4, sdpa, the
# bench's MALLOC_MMAP_THRESHOLD_ (scripts/llama-rows.sh; OWN_ALLOCATOR=1 leaves it out, as
# users run). Seconds per step are each program's own (steps 2..S).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/llama-rows.sh
[ "${LIMIT:-0}" = 1 ] && [ "${N:-2}" != 2 ] &&
  { echo "LIMIT=1 runs one process per core, beside rows of 2 processes (N=2), not $N"; exit 1; }
rounds=${R:-4} steps=${S:-5} out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
step_s() { grep -ho '"step_s": *[0-9.]*' "$1" | head -1 | sed 's/.*: *//'; }
ours() { # processes, run name, extra args
  target/release/accel launch --num-processes "$1" --main-process-port 0 --cpu \
    target/release/examples/llama --model "$model" --data "$data" --steps "$steps" \
    --batch-size 2 --lr 1e-4 --out "$dir/out-$2" "${@:3}" >"$out/$2.log" 2>&1 ||
    { cat "$out/$2.log"; exit 1; }
}
theirs() { # processes, port, run name, extra args
  .venv/bin/torchrun --nproc-per-node="$1" --master-port="$2" \
    python/reference/llama_reference.py memory --model "$model" --data "$data" \
    --steps "$steps" --batch-size 2 "${@:4}" >"$out/$3.log" 2>&1 || { cat "$out/$3.log"; exit 1; }
}
for r in $(seq "$rounds"); do
  if [ "${LIMIT:-0}" = 1 ]; then
    ( export OMP_NUM_THREADS=1
      ours 1 a --strategy ddp ${extra[@]+"${extra[@]}"} & first=$!
      ours 1 b --strategy ddp ${extra[@]+"${extra[@]}"}; wait $first
      theirs 1 29806 c "${limit_theirs[@]}" & first=$!
      theirs 1 29807 d "${limit_theirs[@]}"; wait $first )
    echo "round $r, 1 process each, two at once: accel $(step_s "$out/a.log") $(step_s "$out/b.log") s," \
      "PyTorch $(step_s "$out/c.log") $(step_s "$out/d.log") s"
  fi
  ours "${N:-2}" row --strategy "$strategy" ${extra[@]+"${extra[@]}"}
  theirs "${N:-2}" 29805 ref ${theirs_extra[@]+"${theirs_extra[@]}"}
  a=$(step_s "$out/row.log") t=$(step_s "$out/ref.log")
  echo "$a $t" >>"$out/rounds"
  echo "round $r, ${N:-2} processes: accel $a s, reference $t s"
done
.venv/bin/python - "$out/rounds" "${ROW:-zero3}" "${LEN:-128}" "${N:-2}" <<'SUMMARY'
import statistics as st, sys
rows = [tuple(map(float, line.split())) for line in open(sys.argv[1])]
a, t = [r[0] for r in rows], [r[1] for r in rows]
q = [y / x for x, y in rows]
print(f"{sys.argv[2]}, {sys.argv[3]} tokens, {sys.argv[4]} processes, {len(rows)} rounds: "
      f"accel {min(a):.2f}-{max(a):.2f} s "
      f"(median {st.median(a):.2f}), reference {min(t):.2f}-{max(t):.2f} s (median {st.median(t):.2f}); "
      f"ratio of the medians {st.median(t) / st.median(a):.2f}x, per round {min(q):.2f}-{max(q):.2f}x")
SUMMARY
