#!/usr/bin/env bash
# Build a TensorRT engine from a hydra-export folder with trtexec, without the hydra-deploy package.
#
#   engines/trtexec_build.sh EXPORT_DIR TRT [PRECISION] [-- EXTRA_TRTEXEC_ARGS...]
#
#   TRT        the TensorRT generation on this machine: 8.6 (JetPack 6.0 ships 8.6.2), 10
#              (10.0-10.11; JetPack 6.1 and 6.2 ship 10.3), 10.12 (10.12 and later 10.x) or 11
#   PRECISION  fp16, bf16, fp32, int8 or best (default: the graph's own precision, else fp16);
#              int8 needs an export with QuantizeLinear/DequantizeLinear pairs (hydra-export
#              --precision int8 --int8-method static), read from model.onnx itself
#
# Environment: OUT_DIR (default EXPORT_DIR), GPU_TAG (e.g. orin-sm87, put into the file names),
# MIN_BATCH / OPT_BATCH / MAX_BATCH (default: hydra.json's profile), TRTEXEC (default: trtexec on
# PATH, else /usr/src/tensorrt/bin/trtexec), DRY_RUN=1 (print the command, do not run it),
# TRT_VERSION (e.g. 8.6.2: the TensorRT the command is for, instead of asking trtexec).
#
# The installed TensorRT's version is read from trtexec's banner ("[TensorRT v8602]"); a recipe
# of another generation is refused (trtexec 8.6 fails on --stronglyTyped and --bf16, 11 on --fp16
# and --int8).
# Needs bash and python3 (standard library only: hydra.json is read with the json module and the
# ONNX graph's node names with a small protobuf reader). The command is the one
# `hydra-build EXPORT_DIR --trtexec --trt TRT` prints (a test checks that they agree).
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
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

# The TensorRT on this machine: TRT_VERSION, else trtexec's banner (printed by --help too).
installed=${TRT_VERSION:-}
if [[ -z "$installed" ]]; then
    if banner=$("$trtexec_bin" --help 2>&1); then
        installed=$(printf '%s\n' "$banner" | grep -o -m1 'TensorRT v[0-9]*' | grep -o '[0-9]*$' || true)
    elif [[ "${DRY_RUN:-0}" != "1" ]]; then
        echo "error: cannot run $trtexec_bin --help; install TensorRT (JetPack ships it in /usr/src/tensorrt/bin) or set TRTEXEC" >&2
        exit 1
    fi
fi

command_lines=$(python3 - "$export_dir" "$trt" "$precision" "$installed" <<'PY'
import json
import os
import sys
from pathlib import Path

export_dir, trt, precision, installed = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
GENERATIONS = {"8.6": (8, 6), "10": (10, 0), "10.12": (10, 12), "11": (11, 0)}
HEAD_FLOAT_OPS = {"Softmax", "LogSoftmax", "Exp", "Log", "ReduceSum", "ReduceMean", "ReduceMax",
                  "ReduceLogSumExp", "Mul", "Div", "Sub", "Add", "Neg", "Max", "Min", "Clip",
                  "Sum", "Mean", "CumSum", "LessOrEqual", "GreaterOrEqual", "Less", "Greater",
                  "MatMul"}
# hydra-calibrate --in-graph's nodes (onnx_summary.DECISION_PREFIX, DECISION_FLOAT_OPS)
DECISION_PREFIX = "decisions/"
DECISION_FLOAT_OPS = HEAD_FLOAT_OPS | {"TopK", "ScatterElements"}
# hydra_deploy.engines.onnx_summary's QDQ_OPS and INTEGER_OPS (see there for the sources)
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
INTEGER_OPS = {"ConvInteger", "DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul",
               "MatMulIntegerToFloat", "QGemm", "QAttention", "QEmbedLayerNormalization",
               "DynamicQuantizeLSTM"}
STATIC = ("hydra-export --from EXPORT_DIR --precision int8 --int8-method static --int8-calib DATA "
          "--out NEW_DIR")


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
    """(field number, value) pairs of one protobuf message (hydra_deploy.engines.onnx_summary's
    reader, which this copies: the script runs where the package is not installed)."""
    pos, end = 0, len(buf)
    while pos < end:
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
        if pos > end:  # a length runs past the end: the file was cut short
            raise ValueError("truncated: a field runs past the end of the data")
        yield number, value


def zero_point(tensor):
    """A TensorProto -> (data type, whether every value is zero; None for external data)."""
    data_type, zeros, external = 0, True, False
    for number, value in fields(tensor):
        if number == 2:
            data_type = value
        elif number in (5, 9):  # int32_data / raw_data: zero bytes only
            zeros = zeros and (value == 0 if isinstance(value, int) else not any(bytes(value)))
        elif number == 14 and value == 1:
            external = True
    return data_type, None if external else zeros


def onnx_nodes(path):
    """(name, op_type, inputs, outputs) of every node, in the file's (topological) order, and the
    Q/DQ zero points that are initializers: {name: (data type, all zeros)}."""
    nodes, initializers = [], {}
    try:
        for number, graph in fields(memoryview(path.read_bytes())):
            if number != 7:  # ModelProto.graph
                continue
            for gnum, node in fields(graph):
                if gnum == 5:  # GraphProto.initializer: its name, the rest kept unread
                    for tnum, value in fields(node):
                        if tnum == 8:
                            initializers[bytes(value).decode()] = node
                if gnum != 1:  # GraphProto.node
                    continue
                parts = {1: [], 2: [], 3: [], 4: []}
                for nnum, value in fields(node):
                    if nnum in parts:
                        parts[nnum].append(bytes(value).decode())
                nodes.append(((parts[3] or [""])[0], (parts[4] or [""])[0], parts[1], parts[2]))
        zero_points = {inputs[2]: zero_point(initializers[inputs[2]])
                       for _, op, inputs, _ in nodes
                       if op in QDQ_OPS and len(inputs) > 2 and inputs[2] in initializers}
    except (ValueError, IndexError, TypeError, UnicodeDecodeError) as err:
        fail(f"{str(path)!r} is not a readable ONNX file ({err}); re-export it with hydra-export")
    if not nodes:
        fail(f"{str(path)!r} holds no ONNX graph; re-export it with hydra-export")
    return nodes, zero_points


def explicit_quantization(path, nodes, zero_points):
    """hydra_deploy.engines.onnx_summary.explicit_quantization: Q/DQ pairs TensorRT can build?"""
    found = sorted({op for _, op, _, _ in nodes if op in INTEGER_OPS or op.startswith("QLinear")})
    if found:
        fail(f"{str(path)!r} is quantized with ONNX Runtime's integer operators ({', '.join(found)}; "
             "hydra-export --int8-method dynamic), which TensorRT's ONNX parser cannot import; "
             "re-export with --int8-method static, whose QuantizeLinear/DequantizeLinear pairs "
             f"TensorRT builds in INT8: {STATIC}")
    qdq = [(name, op, inputs) for name, op, inputs, _ in nodes if op in QDQ_OPS]
    refused = []
    for name, op, inputs in qdq:
        if len(inputs) < 3 and op == "QuantizeLinear":
            refused.append(f"{name or op}: no zero point, so ONNX quantizes to uint8")
            continue
        data_type, zeros = zero_points.get(inputs[2] if len(inputs) > 2 else "", (3, True))
        if data_type == 2:
            refused.append(f"{name or op}: a uint8 zero point")
        elif data_type != 3:
            refused.append(f"{name or op}: a zero point of ONNX type {data_type}")
        elif zeros is False:
            refused.append(f"{name or op}: a zero point that is not 0")
    if refused:
        fail(f"{str(path)!r} quantizes in a form TensorRT refuses ({len(refused)} "
             f"QuantizeLinear/DequantizeLinear nodes, e.g. {refused[0]}): TensorRT takes only "
             "symmetric signed INT8 (int8 zero points, all 0); re-export with symmetric int8 "
             f"activations and weights: {STATIC}")
    return bool(qdq)


def fp32_layers(nodes):
    downstream, names = {"member_logits"}, []
    for name, op, inputs, outputs in nodes:
        in_head = any(i in downstream for i in inputs)
        if in_head:
            downstream.update(outputs)
        float_ops = DECISION_FLOAT_OPS if name.startswith(DECISION_PREFIX) else HEAD_FLOAT_OPS
        if op == "LayerNormalization" or (in_head and op in float_ops):
            if not name or "," in name or ":" in name:
                fail(f"node name {name!r} cannot be given to --layerPrecisions; re-export the "
                     "model with hydra-export")
            names.append(name)
    return names


def installed_version(text):
    """'8.6.2', '8602' (8.x banner: major*1000 + minor*100 + patch) or '100300' (10+: major*10000
    + minor*100 + patch) -> (major, minor), or None."""
    if "." in text:
        parts = text.split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    if text.isdigit():
        code = int(text)
        return (code // 10000, code // 100 % 100) if code >= 100000 else (code // 1000, code // 100 % 10)
    return None


def generation_of(version):
    if version < (8, 6):
        fail(f"TensorRT {version[0]}.{version[1]} is too old: the LayerNormalization op needs 8.6 "
             "or newer (JetPack 6.0 ships 8.6.2, 6.1 and 6.2 ship 10.3)")
    if version[0] < 10:
        return "8.6" if version[0] == 8 else "10"
    if version[0] == 10:
        return "10.12" if version[1] >= 12 else "10"
    return "11"


if trt not in GENERATIONS:
    fail(f"unknown TensorRT generation {trt!r}; choose one of {', '.join(GENERATIONS)}")
if installed:
    try:
        here = installed_version(installed)
    except ValueError:
        here = None
    if here is None:
        fail(f"cannot read the TensorRT version {installed!r}; set TRT_VERSION=X.Y")
    if generation_of(here) != trt:
        scripts = {"8.6": "build_trt86_fp16.sh", "10": "build_jetpack6_fp16.sh or build_jetpack6_bf16.sh",
                   "10.12": "build_strongly_typed.sh EXPORT_DIR 10.12", "11": "build_strongly_typed.sh EXPORT_DIR 11"}
        if precision == "int8":
            scripts.update({"8.6": "build_trt86_int8.sh", "10": "build_jetpack6_int8.sh"})
        fail(f"this machine has TensorRT {here[0]}.{here[1]} (generation {generation_of(here)}), but this "
             f"recipe is for generation {trt}; run engines/{scripts[generation_of(here)]} (or "
             f"trtexec_build.sh EXPORT_DIR {generation_of(here)})")
else:
    print(f"note: the TensorRT version is unknown here (no trtexec); the command is for generation {trt}",
          file=sys.stderr)
folder = Path(export_dir)
onnx_path, info_path = folder / "model.onnx", folder / "hydra.json"
if not onnx_path.is_file() or not info_path.is_file():
    fail(f"{export_dir!r} is not an export folder (it needs model.onnx and hydra.json)")
info = json.loads(info_path.read_text(encoding="utf-8"))
graph = info.get("precision", "fp32")
nodes, zero_points = onnx_nodes(onnx_path)
quantized = explicit_quantization(onnx_path, nodes, zero_points)  # INT8: read from the graph
if quantized and graph not in ("int8", "fp32"):
    fail(f"{str(onnx_path)!r} holds QuantizeLinear/DequantizeLinear pairs (INT8) but its record "
         f"gives precision {graph}; re-export the folder with hydra-export")
if graph == "int8" and not quantized:
    fail(f"hydra.json gives precision int8 but {str(onnx_path)!r} holds no "
         "QuantizeLinear/DequantizeLinear pairs; re-export the folder with hydra-export "
         "--precision int8 --int8-method static")
graph = "int8" if quantized else graph
version = GENERATIONS[trt]
if precision is None:
    precision = graph if graph != "fp32" else "fp16"
if precision == "int8" and graph != "int8":
    fail(f"unknown precision 'int8' for this {graph} graph: TensorRT builds INT8 here only from "
         "the graph's own QuantizeLinear/DequantizeLinear pairs; quantize the export: "
         f"{STATIC}")
if precision not in ("fp16", "bf16", "fp32", "int8", "best"):
    fail(f"unknown precision {precision!r}; choose fp16, bf16, fp32, int8 or best")
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
lo = int(os.environ.get("MIN_BATCH") or profile["min"])
hi = int(os.environ.get("MAX_BATCH") or profile["max"])
opt = int(os.environ.get("OPT_BATCH") or min(max(profile["opt"], lo), hi))
if not 1 <= lo <= opt <= hi:
    fail(f"the batch profile must satisfy 1 <= min <= opt <= max, got {lo}, {opt}, {hi}")


def sequence_profile():
    """(1, min(128, L), L): L is the tokenizer's maximum length, else the position embeddings."""
    tokenizer, config = info.get("tokenizer"), info.get("backbone_config")
    longest = (tokenizer.get("max_length") if isinstance(tokenizer, dict) else None) or (
        config.get("max_position_embeddings") if isinstance(config, dict) else None)
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        fail("the model has a dynamic sequence axis but hydra.json records no maximum length "
             "(tokenizer.max_length); re-export it with hydra-export")
    return 1, min(128, longest), longest


shapes = {}
for tensor in info["inputs"]:
    shape = tensor["shape"]
    if not shape or isinstance(shape[0], int):
        fail(f"input {tensor['name']!r} has shape {shape} without a dynamic batch axis first; "
             "export with a dynamic batch (hydra-export does)")
    rest = shape[1:]
    dynamic = [d for d in rest if not (type(d) is int and d > 0)]
    if any(d != "sequence" for d in dynamic):
        fail(f"input {tensor['name']!r} has shape {shape}: only the batch and a text model's "
             "sequence axis may be dynamic for an engine profile; re-export with fixed sizes for "
             "the other axes")
    lengths = sequence_profile() if dynamic else (0, 0, 0)
    shapes[tensor["name"]] = [[b, *(n if d == "sequence" else d for d in rest)]
                              for b, n in zip((lo, opt, hi), lengths)]

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
if flags == ["int8"]:  # INT8 without FP16: the layers outside the Q/DQ pairs stay FP32
    print("note: --int8 turns on TensorRT's explicit quantization of the graph's Q/DQ pairs "
          "(their scales are in model.onnx: no calibration); leave out the --fp16 or --best that "
          "trtexec suggests: they would let TensorRT run LayerNorm, softmax and the ensemble "
          "head in FP16, which this export keeps in FP32", file=sys.stderr)
elif flags:
    names = fp32_layers(nodes)
    if trt == "8.6":  # 8.6's ONNX parser leaves LayerNormalization layers unnamed
        layernorms = {name for name, op, _, _ in nodes if op == "LayerNormalization"}
        kept = [n for n in names if n not in layernorms]
        if len(kept) < len(names):
            print(f"note: TensorRT 8.6 cannot pin the {len(names) - len(kept)} LayerNormalization "
                  "layers to FP32 from the command line (its ONNX parser leaves them unnamed, so "
                  "--layerPrecisions matches none): TensorRT computes them in FP32 but may give "
                  "them FP16 inputs and outputs; hydra-build pins them by layer type, or build "
                  "with TensorRT 10", file=sys.stderr)
        names = kept
    if names:
        args += ["--precisionConstraints=obey",
                 "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in names)]
pinned = bool(flags) and flags != ["int8"] and bool(names)
if precision in ("fp32", "int8") or pinned:  # trtexec enables TF32 unless --noTF32, strongly
    args.append("--noTF32")                  # typed too; FP32-pinned layers of FP16 builds too
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
