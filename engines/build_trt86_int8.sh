#!/usr/bin/env bash
# TensorRT 8.6 (JetPack 6.0 ships 8.6.2): INT8 engine from an export with QuantizeLinear/DequantizeLinear pairs (hydra-export --precision int8 --int8-method static), weakly typed with --int8 alone (8.6 has no strongly typed networks): the pairs' scales quantize the matrix products, every other layer stays FP32 (no --fp16, so LayerNorm needs no pin). An export quantized with --int8-method dynamic is refused (TensorRT cannot parse it).
#
#   engines/build_trt86_int8.sh EXPORT_DIR [-- EXTRA_TRTEXEC_ARGS...]
#
# Same environment variables as engines/trtexec_build.sh (OUT_DIR, GPU_TAG, MIN_BATCH, OPT_BATCH,
# MAX_BATCH, TRTEXEC, DRY_RUN=1).
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 EXPORT_DIR [-- EXTRA_TRTEXEC_ARGS...]" >&2
    exit 2
fi
export_dir=$1
shift
exec bash "$(dirname "$0")/trtexec_build.sh" "$export_dir" 8.6 int8 "$@"
