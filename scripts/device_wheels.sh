#!/usr/bin/env bash
# Wheels for a prepared GPU image that reaches no package registry: Python 3.12, x86-64, with jax,
# flax, optax, orbax-checkpoint, torch and transformers already installed, but not what tunix_train
# needs beyond them. Downloads those (the versions the pins allow, newest first) into DIR (default
# .whl/, which git ignores); scripts/gpu_smoke.sh installs them there without a registry.
#
#     bash scripts/device_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" \
  "hydra-core>=1.3.2,<1.4" "omegaconf>=2.2,<2.4" "tensorboardX>=2.6,<3" "grain>=0.2.18,<0.3" \
  "array-record>=0.8.1" portpicker importlib-resources "gguf>=0.17,<1" \
  "trl>=1.0,<2" "datasets>=3,<6" dill multiprocess  # compare_trl.py's side (the image has accelerate)
# hydra's parser runtime is published as a source archive only: build its (pure Python) wheel here.
python3 -m pip wheel -q --no-deps -w "$out" "antlr4-python3-runtime==4.9.3"
ls "$out"
