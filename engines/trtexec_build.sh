#!/usr/bin/env bash
# Build a TensorRT engine from a hydra-export folder with trtexec, without the hydra-deploy package.
#
#   engines/trtexec_build.sh EXPORT_DIR TRT [PRECISION] [-- EXTRA_TRTEXEC_ARGS...]
#
#   TRT        the TensorRT generation on this machine: 8.6, 10 (10.0-10.11; JetPack 6
#              ships 10.3), 10.12 (10.12 and later 10.x) or 11
#   PRECISION  fp16, bf16, fp32 or best (default: the graph's own precision, else fp16)
#
# Environment: OUT_DIR (default EXPORT_DIR), GPU_TAG (e.g. orin-sm87, put into the file names),
# MIN_BATCH / OPT_BATCH / MAX_BATCH (default: hydra.json's profile), TRTEXEC (default: trtexec on
# PATH, else /usr/src/tensorrt/bin/trtexec), DRY_RUN=1 (print the command, do not run it).
#
# Needs bash and python3 (standard library only: hydra.json is read with the json module and the
# ONNX graph's node names with a small protobuf reader). The command is the one
# `hydra-build EXPORT_DIR --trtexec --trt TRT` prints (a test checks that they agree).
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
export_dir=$1
trt=$2
shift 2
precision=""
if [[ $# -gt 0 && "$1" != "--" ]]; then
    precision=$1
    shift
fi
if [[ $# -gt 0 && "$1" == "--" ]]; then
    shift
fi

trtexec_bin=${TRTEXEC:-}
if [[ -z "$trtexec_bin" ]]; then
    if command -v trtexec >/dev/null 2>&1; then
        trtexec_bin=trtexec
    else
        trtexec_bin=/usr/src/tensorrt/bin/trtexec  # where JetPack puts it
    fi
fi

command_lines=$(python3 - "$export_dir" "$trt" "$precision" <<'PY'
import json
import sys
from pathlib import Path

export_dir, trt, precision = sys.argv[1], sys.argv[2], sys.argv[3] or None
GENERATIONS = {"8.6": (8, 6), "10": (10, 0), "10.12": (10, 12), "11": (11, 0)}
HEAD_FLOAT_OPS = {"Softmax", "LogSoftmax", "Exp", "Log", "ReduceSum", "ReduceMean", "ReduceMax",
                  "ReduceLogSumExp", "Mul", "Div", "Sub", "Add", "Neg", "Max", "Min", "Clip",
                  "Sum", "Mean"}


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def varint(buf, pos):
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def fields(buf):
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def onnx_nodes(path):
    """(name, op_type, inputs, outputs) of every node, in the file's (topological) order."""
    nodes = []
    for number, graph in fields(memoryview(path.read_bytes())):
        if number != 7:  # ModelProto.graph
            continue
        for gnum, node in fields(graph):
            if gnum != 1:  # GraphProto.node
                continue
            parts = {1: [], 2: [], 3: [], 4: []}
            for nnum, value in fields(node):
                if nnum in parts:
                    parts[nnum].append(bytes(value).decode())
            nodes.append(((parts[3] or [""])[0], (parts[4] or [""])[0], parts[1], parts[2]))
    return nodes


def fp32_layers(nodes):
    downstream, names = {"member_logits"}, []
    for name, op, inputs, outputs in nodes:
        in_head = any(i in downstream for i in inputs)
        if in_head:
            downstream.update(outputs)
        if op == "LayerNormalization" or (in_head and op in HEAD_FLOAT_OPS):
            if not name or "," in name or ":" in name:
                fail(f"node name {name!r} cannot be given to --layerPrecisions; re-export the "
                     "model with hydra-export")
            names.append(name)
    return names


if trt not in GENERATIONS:
    fail(f"unknown TensorRT generation {trt!r}; choose one of {', '.join(GENERATIONS)}")
folder = Path(export_dir)
onnx_path, info_path = folder / "model.onnx", folder / "hydra.json"
if not onnx_path.is_file() or not info_path.is_file():
    fail(f"{export_dir!r} is not an export folder (it needs model.onnx and hydra.json)")
info = json.loads(info_path.read_text(encoding="utf-8"))
graph = info.get("precision", "fp32")
version = GENERATIONS[trt]
if precision is None:
    precision = graph if graph != "fp32" else "fp16"
if precision not in ("fp16", "bf16", "fp32", "best"):
    fail(f"unknown precision {precision!r}; choose fp16, bf16, fp32 or best")
reexport = (f"export a graph that carries its precision: hydra-export --from EXPORT_DIR "
            f"--precision {precision if precision != 'best' else 'fp16'} --out NEW_DIR")
if graph != "fp32":
    precision = graph if precision == "best" else precision
    if precision != graph:
        fail(f"model.onnx was exported in {graph}; build it with precision {graph} or re-export")
    if graph == "bf16" and version < (10, 0):
        fail("BF16 needs TensorRT 10 or newer; re-export with --precision fp16")
    strongly_typed = version >= (10, 0)
    flags = [] if strongly_typed else [graph]
else:
    if precision == "best":
        precision = "fp16"
        print("note: precision best: the target GPU is unknown here, so FP16 (ask for bf16 where "
              "the GPU has compute capability 8.0 or newer)", file=sys.stderr)
    if precision == "bf16" and version < (10, 0):
        fail("BF16 needs TensorRT 10 or newer; use precision fp16")
    if precision == "fp32":
        strongly_typed, flags = version >= (10, 12), []
    elif version >= (10, 12):
        fail(f"TensorRT {trt} builds reduced precision only from a strongly typed graph; {reexport}")
    else:
        strongly_typed, flags = False, [precision]

profile = info.get("batch_profile") or {"min": 1, "opt": 8, "max": 32}
import os  # noqa: E402  (environment overrides of the profile)
lo = int(os.environ.get("MIN_BATCH") or profile["min"])
hi = int(os.environ.get("MAX_BATCH") or profile["max"])
opt = int(os.environ.get("OPT_BATCH") or min(max(profile["opt"], lo), hi))
if not 1 <= lo <= opt <= hi:
    fail(f"the batch profile must satisfy 1 <= min <= opt <= max, got {lo}, {opt}, {hi}")
shapes = {}
for tensor in info["inputs"]:
    rest = tensor["shape"][1:]
    if not all(isinstance(d, int) for d in rest):
        fail(f"input {tensor['name']!r}: only the batch axis may be dynamic")
    shapes[tensor["name"]] = [[b, *rest] for b in (lo, opt, hi)]

out_dir = Path(os.environ.get("OUT_DIR") or export_dir)
gpu = os.environ.get("GPU_TAG") or None
stem = ".".join(["model", info["onnx_sha256"][:12], precision, *([gpu] if gpu else []), f"trt{trt}"])
cache = ".".join(["timing", *([gpu] if gpu else []), f"trt{trt}", "cache"])
args = [f"--onnx={onnx_path}"]
for index, key in enumerate(("min", "opt", "max")):
    args.append(f"--{key}Shapes=" + ",".join(
        f"{name}:{'x'.join(str(d) for d in s[index])}" for name, s in shapes.items()))
if strongly_typed:
    args.append("--stronglyTyped")
args += [f"--{flag}" for flag in flags]
if flags:
    names = fp32_layers(onnx_nodes(onnx_path))
    if names:
        args += ["--precisionConstraints=obey",
                 "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in names)]
if precision == "fp32" and not strongly_typed:
    args.append("--noTF32")
args += [f"--saveEngine={out_dir / (stem + '.engine')}",
         f"--timingCacheFile={out_dir / cache}",
         "--profilingVerbosity=detailed", "--dumpLayerInfo",
         f"--exportLayerInfo={out_dir / (stem + '.layers.json')}"]
print("\n".join(args))
PY
)

mapfile -t args <<<"$command_lines"
args+=("$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "$trtexec_bin" "${args[@]}"
    printf '\n'
    exit 0
fi
mkdir -p "${OUT_DIR:-$export_dir}"
echo "+ $trtexec_bin ${args[*]}" >&2
exec "$trtexec_bin" "${args[@]}"
