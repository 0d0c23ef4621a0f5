#!/usr/bin/env bash
# On a prepared GPU image without a package registry: installs the wheels of scripts/device_wheels.sh
# (DIR, default .whl/) and tunix_train offline, then runs the GPU checks whose figures go into
# docs/performance.md. Each check prints its own result; OUT (default ./gpu_smoke) keeps the JSON.
#
#     bash scripts/gpu_smoke.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.whl}
out=${OUT:-gpu_smoke}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --find-links "$wheels" "$wheels"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
python3 -c 'import jax, flax; print(f"jax {jax.__version__}, flax {flax.__version__}, devices {jax.devices()}")'

gemma=(model=gemma3_1b 'model.mesh_shape=[[1],["fsdp"]]' data=synthetic data.seq_len=4096
       training.mixed_precision=bf16)
# The model's kernels and mesh equivalence on the GPU's own compiler (no fake devices there).
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py
# Throughput and MFU against the data-sheet bf16 peak: cuDNN attention against XLA's, two batch sizes.
for attention in cudnn xla; do
  for micro in 1 2; do
    python3 scripts/benchmark.py --steps 20 --warmup 3 --json "$out/gemma3_1b_${attention}_mb${micro}.json" \
      "${gemma[@]}" "training.attention=$attention" "training.micro_batch_size=$micro" || true
  done
done
# The cost of deterministic kernels, and the same step in torch + transformers (eager and compiled)
python3 scripts/benchmark.py --steps 10 --warmup 2 --json "$out/gemma3_1b_nondeterministic.json" \
  "${gemma[@]}" training.micro_batch_size=2 training.deterministic=false || true
for compiled in "" --compile; do
  python3 scripts/torch_peer.py --model gemma3_1b --seq-len 4096 --batch 2 $compiled \
    --json "$out/gemma3_1b_torch${compiled:+_compiled}.json" || true
done
# The engine's bf16 decode at 1, 8 and 64 requests against the measured memory bandwidth
python3 scripts/benchmark_generate.py --model gemma3_1b --dtype bf16 --no-transformers --batches 1 8 64 \
  --prompt-len 64 --new-tokens 128 --json "$out/gemma3_1b_decode.json" || true
# Rollouts at 16, 64 and 256 slots (a decode step's cost grows little with its rows on a GPU), and
# one GRPO step against TRL's (carried as a wheel) in float32 and bf16
for slots in 16 64 256; do
  python3 scripts/benchmark_rollout.py --devices 1 --dtype bf16 --slots $slots --requests $((4 * slots)) \
    > "$out/rollout_$slots.txt" || true
done
for dtype in float32 bf16; do
  python3 scripts/compare_trl.py --model small --rounds 2 --dtype $dtype > "$out/grpo_trl_$dtype.txt" || true
done
# The planner's prediction for the same step, to compare with the benchmark's measured peak memory.
JAX_PLATFORMS=cpu python3 -m tunix_train.plan "${gemma[@]}" training.micro_batch_size=1 --device_memory=80GB
# Host offload: the moments, then the moments and the float32 master weights, against neither above
# (peak device memory and tokens/s in the JSON).
for offload in "training.offload_optimizer_state=true" \
               "training.offload_optimizer_state=true training.offload_master_weights=true"; do
  name=$(echo "$offload" | grep -q master && echo both || echo moments)
  python3 scripts/benchmark.py --steps 20 --warmup 3 --json "$out/gemma3_1b_offload_${name}.json" \
    "${gemma[@]}" training.attention=cudnn training.micro_batch_size=2 $offload || true
done
