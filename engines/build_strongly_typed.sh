#!/usr/bin/env bash
# TensorRT 10.12+ / 11: build an export that carries its own precision (hydra-export --precision
# fp16|bf16, or int8 --int8-method static: QuantizeLinear/DequantizeLinear pairs) with
# --stronglyTyped; the engine computes in the graph's precision.
#
#   engines/build_strongly_typed.sh EXPORT_DIR [10.12|11] [-- EXTRA_TRTEXEC_ARGS...]
#
# Same environment variables as engines/trtexec_build.sh (OUT_DIR, GPU_TAG, MIN_BATCH, OPT_BATCH,
# MAX_BATCH, TRTEXEC, DRY_RUN=1).
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 EXPORT_DIR [10.12|11] [-- EXTRA_TRTEXEC_ARGS...]" >&2
    exit 2
fi
export_dir=$1
shift
trt=10.12
if [[ $# -gt 0 && "$1" != "--" ]]; then
    trt=$1
    shift
fi
exec bash "$(dirname "$0")/trtexec_build.sh" "$export_dir" "$trt" "$@"
