#!/usr/bin/env bash
# TensorRT 10.0-10.11 (JetPack 6.1 and 6.2 ship 10.3; JetPack 6.0 ships 8.6.2, which has no BF16: this script refuses it) on a GPU with SM >= 80 (Jetson Orin: SM 87): BF16 engine; weakly typed --bf16 with LayerNorm in FP32 for an FP32 export, --stronglyTyped for a BF16 export.
#
#   engines/build_jetpack6_bf16.sh EXPORT_DIR [-- EXTRA_TRTEXEC_ARGS...]
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
exec bash "$(dirname "$0")/trtexec_build.sh" "$export_dir" 10 bf16 "$@"
