#!/usr/bin/env bash
# TensorRT 8.6 (JetPack 6.0 ships 8.6.2; JetPack 5 ships 8.5, which cannot parse LayerNormalization): FP16 engine, weakly typed (--fp16), the ensemble head kept in FP32; LayerNorm is computed in FP32 by TensorRT but cannot be pinned by name on 8.6 (the script says so).
#
#   engines/build_trt86_fp16.sh EXPORT_DIR [-- EXTRA_TRTEXEC_ARGS...]
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
exec bash "$(dirname "$0")/trtexec_build.sh" "$export_dir" 8.6 fp16 "$@"
