#!/usr/bin/env bash
# Builds here what scripts/gpu-check.sh runs on a GPU machine, into target/gpu-check: the
# release binaries (stripped; on the GPU machine they find torch 2.11.0's libraries through
# LD_LIBRARY_PATH), accel-core's unit-test binary, and the parity fixtures (made with
# .venv's torch). Carry target/gpu-check over (it stays well under 64 MiB) and run
# `bash scripts/gpu-check.sh` from the repository root there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check
examples=(train parity char_lm lm_bench memory_bench llama)
cargo build --release -p accel-core --bin accel -p accel-examples "${examples[@]/#/--example=}"
tests=$(cargo test --release -p accel-core --lib --no-run --message-format json |
  .venv/bin/python -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
rm -rf "$out" && mkdir -p "$out/bin"
cp target/release/accel "$out/bin/"
for e in "${examples[@]}"; do cp "target/release/examples/$e" "$out/bin/"; done
cp "$tests" "$out/bin/accel_core_tests"
strip "$out"/bin/*
.venv/bin/python python/reference/parity_accelerate.py make --n 45 --d 10 --hidden 16,16 \
  --classes 3 --seed 0 --init "$out/W.safetensors" --data "$out/D.safetensors"
# A small Llama checkpoint (transformers' own classes) for generation by a device map.
.venv/bin/python python/reference/hf_families.py make --variant llama --out "$out/llama-small"
du -sh "$out"
