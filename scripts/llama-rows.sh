# Sourced by profile-llama.sh and llama-rounds.sh: the inputs `cargo xtask bench llama` made,
# the bench's malloc setting, and the row that ROW names — zero3 (accel zero3 beside torch's
# FSDP2), zero3-ac (both with activation checkpointing) or lora (accel DDP + LoRA r8 beside
# transformers + peft + Accelerate). limit_theirs: PyTorch's side of what the compute allows
# (its DDP at world size 1 doing the row's work). LEN=1024 for rows of 1024 tokens instead
# of 128.
dir=target/bench-llama model=target/bench-llama/model-100m data=target/bench-llama/tokens.safetensors
[ "${LEN:-128}" = 1024 ] && data=target/bench-llama/tokens-1024.safetensors
[ -f "$model/config.json" ] && [ -x target/release/examples/llama ] ||
  { echo "run \`cargo xtask bench llama\` first (it makes $model and the binaries)"; exit 1; }
case ${ROW:-zero3} in
  zero3) strategy=zero3 extra=() theirs_extra=() limit_theirs=(--ddp)
    names=("accel zero3" "torch FSDP2") ;;
  zero3-ac) strategy=zero3 extra=(--activation-checkpointing) theirs_extra=(--checkpointing)
    limit_theirs=(--ddp --checkpointing) names=("accel zero3 + AC" "torch FSDP2 + AC") ;;
  lora) strategy=ddp extra=(--lora-r 8) theirs_extra=(--lora-r 8) limit_theirs=(--lora-r 8)
    names=("accel LoRA" "peft LoRA") ;;
  *) echo "ROW is zero3, zero3-ac or lora, not $ROW"; exit 1 ;;
esac
[ "${OWN_ALLOCATOR:-0}" = 1 ] || export MALLOC_MMAP_THRESHOLD_=65536
