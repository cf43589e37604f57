#!/usr/bin/env bash
# What one GPU can prove (benchmarks/device/gpu_check.py): every collective at world size 1 on
# NCCL with CUDA tensors, each compressor's round trip and cost per MB against torch's PowerSGD
# hook, the fused modules' forward and backward on CUDA, and the training loop at world size 1
# (commfuse train --device cuda --backend nccl: a few steps, a checkpoint and its resume;
# commfuse bench strategies). At most 8 minutes; the JSON report goes to
# OUTDIR/gpu_check.json. Exit 2 without CUDA, 1 when a check failed.
#
# Usage, from the repository root: benchmarks/device/gpu_check.sh OUTDIR [--device cpu --backend gloo]
set -uo pipefail
out=${1:?usage: $0 OUTDIR [--device cpu --backend gloo]}
shift
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "${PYTHON:-python3}" benchmarks/device/gpu_check.py "$out" "$@"
