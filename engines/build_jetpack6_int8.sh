#!/usr/bin/env bash
# TensorRT 10.0-10.11 (JetPack 6.1 and 6.2 ship 10.3; JetPack 6.0 ships 8.6.2: use build_trt86_int8.sh there, this script refuses it): INT8 engine from an export with QuantizeLinear/DequantizeLinear pairs (hydra-export --precision int8 --int8-method static), built --stronglyTyped: the pairs' scales quantize the matrix products, LayerNorm, softmax and the ensemble head stay FP32 as exported. An export quantized with --int8-method dynamic is refused (TensorRT cannot parse it).
#
#   engines/build_jetpack6_int8.sh EXPORT_DIR [-- EXTRA_TRTEXEC_ARGS...]
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
exec bash "$(dirname "$0")/trtexec_build.sh" "$export_dir" 10 int8 "$@"
