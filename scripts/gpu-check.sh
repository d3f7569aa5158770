#!/usr/bin/env bash
# The CUDA-side checks, in one go, for a machine with NVIDIA GPUs and torch 2.11.0 (+cu130)
# in its python3 (binaries built elsewhere and carried over: LD_LIBRARY_PATH points at that
# torch/lib). Prints what a GPU session reports in its notes.
#   bash scripts/gpu-check.sh [path/to/target/debug]
set -u
bin=${1:-target/debug}
torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "== accel env"; "$bin/accel" env
echo "== one process on cuda:0: the main job (bf16) and the CNN"
"$bin/examples/train" --precision bf16 --epochs 10 --out /tmp/accel-gpu-train
"$bin/examples/train" --precision fp16 --epochs 10 --out /tmp/accel-gpu-train-fp16
echo "== NCCL between $(( gpus < 2 ? gpus : 2 )) processes"
if [ "$gpus" -ge 2 ]; then
  "$bin/accel" launch --num-processes 2 --main-process-port 0 --timeout 120 "$bin/accel" worker nccl
else
  echo "fewer than 2 GPUs: NCCL check with 1 process"
  "$bin/accel" launch --num-processes 1 --main-process-port 0 --timeout 120 "$bin/accel" worker nccl
fi
echo "== fp8 on cuda:0 (needs compute capability 8.9+): char_lm, then fp8 vs bf16 step time of a"
echo "   GPT of width 2048 beside Accelerate + torchao on the same GPU"
"$bin/examples/char_lm" --precision fp8 --steps 200 --target 10
for precision in bf16 fp8; do
  "$bin/examples/lm_bench" --device cuda --precision $precision --width 2048 --heads 16 \
    --blocks 4 --context 512 --batch 8 --steps 20
  python3 python/reference/accelerate_lm.py --device cuda --fused --precision $precision \
    --width 2048 --heads 16 --blocks 4 --context 512 --batch 8 --steps 20
done
echo "== CPU reference timing"
"$bin/examples/mlp_bench"
