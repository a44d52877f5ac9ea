"""Stand-ins for TensorRT, Polygraphy's TensorRT loaders and trtexec, as strict as the real ones
where hydra-deploy meets them. What each one copies, and from where:

- ``host_memory``: ``tensorrt.IHostMemory`` (``builder.build_serialized_network``'s result) has the
  buffer protocol, ``nbytes`` and ``dtype`` but no ``__len__``, and is always truthy (TensorRT
  ``python/src/infer/pyFoundationalTypes.cpp``, v8.6.1 to v11.0).
- ``parse_onnx``: the network TensorRT's ONNX parser makes. onnx-tensorrt 8.6-GA turns INT64
  inputs into INT32 (``convertDtype``) and leaves the INormalizationLayer of a LayerNormalization
  node unnamed (its importer returns without ``registerLayer``); 10.0-GA names it and keeps INT64.
- ``tensorrt_module``: ``nptype`` maps no BF16 (and no INT64 on 8.6) and raises TypeError there
  (``python/packaging/bindings_wheel/tensorrt/__init__.py``); ``DataType`` members print as
  ``DataType.BF16``; 8.6 has no ``bfloat16`` and no ``STRONGLY_TYPED`` network flag.
- ``polygraphy_module``: ``NetworkFromOnnxPath()`` returns (builder, network, parser);
  ``EngineBytesFromNetwork`` takes that tuple (or a loader), returns the IHostMemory and writes the
  timing cache to ``save_timing_cache`` (Polygraphy 0.53.6 ``backend/trt/loader.py``); a
  strongly typed network or BF16 on TensorRT 8.6 fails as Polygraphy's ``fail_unavailable`` does,
  and so does ``CreateConfig(int8=True)`` on TensorRT 11, which has no ``BuilderFlag::kINT8``
  (NvInfer.h v11.0; Polygraphy's ``try_set_flag``, ``backend/trt/config.py`` v11.0 lines 537-541).
  On 8.6 a network with Q/DQ layers needs ``int8=True`` (developer guide 8.6, "Working with
  INT8": the INT8 flag must be set for any quantized operation; 8.6 has no strong typing).
  A strongly typed network refuses layer precisions ("Strongly-typed networks reject calls to
  method setPrecision", NvInfer.h v10.3.0 line 661) and precision builder flags (trtexec: "setting
  ... mode is not allowed if graph is strongly typed", sampleOptions.cpp v10.3.0 lines 1233-1247).
- ``engine_file`` / ``Runtime`` / ``TrtRunner``: a deserialized engine whose I/O dtypes are the
  release's parser's (INT32 token ids on 8.6), and Polygraphy's ``TrtRunner``, which with
  ``check_inputs=False`` copies the host arrays' bytes to the device as they are (Polygraphy 0.53.6
  ``backend/trt/runner.py``): an array of another dtype than the engine's is refused here, where
  the real one would hand TensorRT reinterpreted bytes. Outputs come from ONNX Runtime.
- ``write_trtexec``: a trtexec of one TensorRT release: ``--help`` prints the banner with the
  version (``samples/common/logging.h``: ``[TensorRT v8602]``, 10+: ``v100300``), an option its
  ``sampleOptions.cpp`` does not parse fails with ``Unknown option`` (the option names per tag are
  in ``tests/data/trtexec_options.json``), and ``--layerPrecisions`` names that match no layer of
  that release's parser are reported (trtexec ignores them silently, ``sampleEngines.cpp``). On 11,
  ``--int8`` is refused too: the file still spells it, but only ``SafeBuilderOptions::parse``
  (sampleOptions.cpp v11.0 lines 1723-1742), not trtexec's ``BuildOptions::parse``, reads it.
"""

from __future__ import annotations

import ctypes
import enum
import json
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: helpers/ and data/ are in it
OPTIONS = json.loads((TESTS / "data" / "trtexec_options.json").read_text())["versions"]
# a release of each trtexec generation (and the key of its option list in OPTIONS)
RELEASES = {
    "8.6": ("8.6.2", "8.6"),
    "10": ("10.3.0", "10"),
    "10.12": ("10.13.0", "10.13"),
    "11": ("11.0.0", "11"),
}
# options the file spells that trtexec does not parse, per option-list key (see the docstring)
NOT_TRTEXEC = {"11": {"--int8"}, "11.1": {"--int8"}}


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8


class LayerType(enum.Enum):
    NORMALIZATION = 0
    ELEMENTWISE = 1
    MATRIX_MULTIPLY = 2
    SOFTMAX = 3
    OTHER = 4
    QUANTIZE = 5
    DEQUANTIZE = 6


def parse_version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def host_memory(data: bytes, dtype: DataType = DataType.UINT8):
    """A buffer-only object like ``tensorrt.IHostMemory``: memoryview-able, ``nbytes``, no len()."""

    class IHostMemory(ctypes.Structure):
        _fields_ = [("_data", ctypes.c_ubyte * len(data))]

        @property
        def nbytes(self) -> int:
            return ctypes.sizeof(self)

        @property
        def dtype(self) -> DataType:
            return dtype

    return IHostMemory.from_buffer_copy(data)


# --- the network the ONNX parser makes --------------------------------------------------------------
class Tensor:
    def __init__(self, name: str, dtype: DataType):
        self.name, self.dtype = name, dtype


class Layer:
    """An ILayer: ``precision`` reads FLOAT until set; ``precision_is_set`` says whether it was.
    TensorRT 11 has no ``ILayer.precision`` (pyGraph.cpp v11.0: weak typing is gone); a layer of
    a strongly typed network refuses it (``strongly_typed``)."""

    def __init__(
        self, name: str, type: LayerType, has_precision: bool = True, strongly_typed: bool = False
    ):
        self.name, self.type, self._precision = name, type, None
        self._has_precision, self._strongly_typed = has_precision, strongly_typed

    @property
    def precision(self) -> DataType:
        if not self._has_precision:
            raise AttributeError("'tensorrt.ILayer' object has no attribute 'precision'")
        return self._precision or DataType.FLOAT

    @precision.setter
    def precision(self, value: DataType) -> None:
        if not self._has_precision:
            raise AttributeError("'tensorrt.ILayer' object has no attribute 'precision'")
        if self._strongly_typed:
            raise RuntimeError("Strongly-typed networks reject calls to method setPrecision")
        self._precision = value

    @property
    def precision_is_set(self) -> bool:
        return self._precision is not None


class Network:
    def __init__(
        self,
        layers: list[Layer],
        inputs: list[Tensor],
        outputs: list[Tensor],
        strongly_typed: bool = False,
    ):
        self.layers, self.inputs, self.outputs = layers, inputs, outputs
        self.strongly_typed = strongly_typed

    num_layers = property(lambda self: len(self.layers))
    num_inputs = property(lambda self: len(self.inputs))
    num_outputs = property(lambda self: len(self.outputs))

    def get_layer(self, index: int) -> Layer:
        return self.layers[index]

    def get_input(self, index: int) -> Tensor:
        return self.inputs[index]

    def get_output(self, index: int) -> Tensor:
        return self.outputs[index]


ONNX_DTYPES = {
    1: DataType.FLOAT,
    10: DataType.HALF,
    16: DataType.BF16,
    3: DataType.INT8,
    6: DataType.INT32,
    7: DataType.INT64,
    9: DataType.BOOL,
    2: DataType.UINT8,
}
LAYER_TYPES = {
    "LayerNormalization": LayerType.NORMALIZATION,
    "MatMul": LayerType.MATRIX_MULTIPLY,
    "Softmax": LayerType.SOFTMAX,
    "Add": LayerType.ELEMENTWISE,
    "Mul": LayerType.ELEMENTWISE,
    "QuantizeLinear": LayerType.QUANTIZE,
    "DequantizeLinear": LayerType.DEQUANTIZE,
}


def parse_onnx(path: str | Path, version: str, strongly_typed: bool = False) -> Network:
    """The layers and I/O tensors TensorRT ``version``'s ONNX parser makes from ``path``.

    A graph that ``version``'s parser refuses or reads otherwise than ONNX Runtime (the table of
    ``hydra_deploy.engines.onnx_support``: e.g. a Shape with start/end on 8.6, a DequantizeLinear
    over INT32, BF16 on 8.6, ONNX Runtime's integer operators) is refused, as Polygraphy's
    ``NetworkFromOnnxPath`` fails after the parser's errors ("Failed to parse ONNX model")."""
    import onnx

    from hydra_deploy.engines.onnx_support import parser_problems

    old = parse_version(version) < (10, 0)
    model = onnx.load(str(path), load_external_data=False)
    problems = parser_problems(model, version)
    if problems:
        raise RuntimeError(
            f"Failed to parse ONNX model {path} with TensorRT {version}'s parser: "
            + "; ".join(problems[:3])
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        )
    initializers = {i.name for i in model.graph.initializer}

    def dtype(value_info) -> DataType:
        found = ONNX_DTYPES[value_info.type.tensor_type.elem_type]
        return DataType.INT32 if old and found is DataType.INT64 else found  # convertDtype (8.6)

    layers = []
    for index, node in enumerate(model.graph.node):
        kind = LAYER_TYPES.get(node.op_type, LayerType.OTHER)
        unnamed = old and node.op_type == "LayerNormalization"  # no registerLayer on 8.6
        name = f"(Unnamed Layer* {index}) [Normalization]" if unnamed else node.name
        has_precision = parse_version(version) < (11, 0)
        layers.append(Layer(name, kind, has_precision, strongly_typed=strongly_typed))
    inputs = [Tensor(i.name, dtype(i)) for i in model.graph.input if i.name not in initializers]
    outputs = [Tensor(o.name, dtype(o)) for o in model.graph.output]
    return Network(layers, inputs, outputs, strongly_typed=strongly_typed)


# --- tensorrt and polygraphy.backend.trt ---------------------------------------------------------------
class Unavailable(Exception):
    """What Polygraphy's ``fail_unavailable`` raises (a PolygraphyException)."""


def tensorrt_module(version: str) -> types.ModuleType:
    """``import tensorrt`` of one release, as far as hydra-deploy uses it."""
    import numpy as np

    old = parse_version(version) < (10, 0)
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.DataType, trt.LayerType = DataType, LayerType
    trt.float32, trt.float16, trt.int32, trt.int8, trt.bool = (
        DataType.FLOAT,
        DataType.HALF,
        DataType.INT32,
        DataType.INT8,
        DataType.BOOL,
    )
    if not old:
        trt.int64, trt.bfloat16 = DataType.INT64, DataType.BF16
    mapping = {
        DataType.FLOAT: np.float32,
        DataType.HALF: np.float16,
        DataType.INT8: np.int8,
        DataType.INT32: np.int32,
        DataType.BOOL: np.bool_,
        DataType.UINT8: np.uint8,
    }
    if not old:
        mapping[DataType.INT64] = np.int64

    def nptype(trt_type):
        if trt_type in mapping:
            return mapping[trt_type]
        raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")

    trt.nptype = nptype
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level=None: None})

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            record = json.loads(bytes(data))
            if record.get("version") != version:  # engines run on the release that built them
                return None
            return Engine(record["onnx"], version, record["profile"], trt)

    trt.Runtime = Runtime
    return trt


def engine_file(path: Path, onnx_path: Path, version: str, profile: dict) -> Path:
    """An engine file the stand-in Runtime deserializes: ``profile`` {input: [min, opt, max]}."""
    record = {"onnx": str(onnx_path), "version": version, "profile": profile}
    path.write_text(json.dumps(record))
    return path


class Engine:
    """An ICudaEngine: I/O tensors from the release's parser, shapes from the ONNX file."""

    def __init__(self, onnx_path: str, version: str, profile: dict, trt):
        import onnx

        self.onnx_path, self.profile, self.trt = onnx_path, profile, trt
        network = parse_onnx(onnx_path, version)
        graph = onnx.load(onnx_path, load_external_data=False).graph
        dims = {
            v.name: [
                d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim
            ]
            for v in [*graph.input, *graph.output]
        }
        self.tensors = [(t.name, t.dtype, "INPUT", dims[t.name]) for t in network.inputs] + [
            (t.name, t.dtype, "OUTPUT", dims[t.name]) for t in network.outputs
        ]
        self.num_io_tensors = len(self.tensors)

    def _find(self, name):
        return next(t for t in self.tensors if t[0] == name)

    def get_tensor_name(self, index):
        return self.tensors[index][0]

    def get_tensor_dtype(self, name):
        return self._find(name)[1]

    def get_tensor_mode(self, name):
        return self._find(name)[2]

    def get_tensor_shape(self, name):
        return list(self._find(name)[3])

    def get_tensor_profile_shape(self, name, index):
        return [tuple(shape) for shape in self.profile[name]]


class TrtRunner:
    """Polygraphy's TrtRunner over the stand-in Engine; ``feeds`` records what it was given."""

    feeds: list = []  # noqa: RUF012 (shared record, reset by the tests)

    def __init__(self, engine, optimization_profile=None):
        self.engine, self.is_active = engine, False

    def activate(self):
        self.is_active = True

    def deactivate(self):
        self.is_active = False

    def infer(self, feed, check_inputs=True):
        import onnxruntime as ort

        trt = self.engine.trt
        for name, array in feed.items():
            want = trt.nptype(self.engine.get_tensor_dtype(name))
            if array.dtype != want:  # the real one copies the bytes as they are
                raise TypeError(f"{name}: {array.dtype} bytes for a {want.__name__} tensor")
            low, _, high = self.engine.get_tensor_profile_shape(name, 0)
            if not all(lo <= n <= hi for lo, n, hi in zip(low, array.shape, high, strict=True)):
                raise ValueError(f"{name}: shape {array.shape} outside the profile {low}..{high}")
        TrtRunner.feeds.append({name: array.dtype.name for name, array in feed.items()})
        session = ort.InferenceSession(self.engine.onnx_path, providers=["CPUExecutionProvider"])
        types_ = {i.name: i.type for i in session.get_inputs()}
        onnx_feed = {
            n: a.astype("int64") if types_[n] == "tensor(int64)" else a for n, a in feed.items()
        }
        names = [o.name for o in session.get_outputs()]
        outputs = dict(zip(names, session.run(None, onnx_feed), strict=True))
        return {
            n: v.astype(trt.nptype(self.engine.get_tensor_dtype(n))) for n, v in outputs.items()
        }


def polygraphy_module(
    version: str, calls: dict | None = None, engine: bytes = b"serialized-engine"
) -> types.ModuleType:
    """``polygraphy.backend.trt`` over TensorRT ``version``; ``calls`` records what was asked."""
    old = parse_version(version) < (10, 0)
    calls = calls if calls is not None else {}
    module = types.ModuleType("polygraphy.backend.trt")

    class NetworkFromOnnxPath:
        def __init__(self, path, strongly_typed=None):
            self.path, self.strongly_typed = path, strongly_typed
            calls["network"] = (path, strongly_typed)

        def __call__(self):
            if self.strongly_typed and old:  # NetworkDefinitionCreationFlag.STRONGLY_TYPED
                raise Unavailable("'strongly_typed' is not available on this version of TensorRT")
            network = parse_onnx(self.path, version, strongly_typed=bool(self.strongly_typed))
            calls["parsed"] = network
            return ("builder", network, "parser")

    class SetLayerPrecisions:  # by layer name, as Polygraphy's
        """Stricter than Polygraphy's, for hydra-deploy's own rule: on a weakly typed network of a
        graph with decisions (``hydra-calibrate --in-graph``), every floating-point layer the
        parser makes of a ``decisions/...`` node must be given FP32, or it fails naming them
        (recorded as ``calls["uncovered"]``; tests/helpers/decision_layers.py)."""

        def __init__(self, network, layer_precisions):
            self.network, self.layer_precisions = network, layer_precisions
            calls["layer_precisions"] = layer_precisions

        def __call__(self):
            built = self.network() if callable(self.network) else self.network
            for layer in built[1].layers:
                if layer.name in self.layer_precisions:
                    layer.precision = self.layer_precisions[layer.name]
            path = calls.get("network", (None,))[0]  # NetworkFromOnnxPath's file
            if path is not None and not built[1].strongly_typed:
                from helpers.decision_layers import uncovered_decision_layers

                fp32 = {n for n, p in self.layer_precisions.items() if p is DataType.FLOAT}
                layers = {layer.name for layer in built[1].layers}
                calls["uncovered"] = uncovered_decision_layers(path, fp32, layers)
                if calls["uncovered"]:
                    raise RuntimeError(
                        "decision layers left to reduced precision (no FP32 layer precision "
                        "reaches them): " + ", ".join(calls["uncovered"])
                    )
            return built

    class Profile(dict):
        def add(self, name, min, opt, max):  # Polygraphy's argument names
            self[name] = (list(min), list(opt), list(max))
            return self

    def CreateConfig(**kwargs):  # Polygraphy's name
        if kwargs.get("bf16") and old:  # BuilderFlag.BF16 came with TensorRT 9
            raise Unavailable("'bf16' is not available on this version of TensorRT")
        if kwargs.get("int8") and parse_version(version) >= (11, 0):  # no BuilderFlag.INT8
            raise Unavailable("'int8' is not available on this version of TensorRT")
        calls["config"] = kwargs
        return kwargs

    class EngineBytesFromNetwork:
        def __init__(self, network, config=None, save_timing_cache=None):
            self.network, self.config, self.timing_cache = network, config, save_timing_cache
            calls["save_timing_cache"] = save_timing_cache

        def __call__(self):
            built = self.network() if callable(self.network) else self.network
            _, network, _ = built
            flags = [f for f in ("fp16", "bf16", "int8") if (self.config or {}).get(f)]
            if network.strongly_typed and flags:
                raise RuntimeError(
                    f"setting {flags[0]} mode is not allowed if graph is strongly typed"
                )
            qdq = {LayerType.QUANTIZE, LayerType.DEQUANTIZE}
            if old and "int8" not in flags and any(layer.type in qdq for layer in network.layers):
                # developer guide 8.6, "Working with INT8": the INT8 flag must be set in the
                # builder configuration for any quantized operation
                raise RuntimeError("Q/DQ layers in the network but BuilderFlag::kINT8 is not set")
            calls["pinned"] = {
                layer.name: layer.precision for layer in network.layers if layer.precision_is_set
            }
            if self.timing_cache:
                Path(self.timing_cache).write_bytes(b"timing-cache")
            return host_memory(engine)

    for item in (
        NetworkFromOnnxPath,
        SetLayerPrecisions,
        Profile,
        CreateConfig,
        EngineBytesFromNetwork,
    ):
        setattr(module, item.__name__, item)
    return module


# --- trtexec --------------------------------------------------------------------------------------
def version_code(version: str) -> int:
    """NV_TENSORRT_VERSION: major*1000 + minor*100 + patch on 8.x, major*10000 + ... from 10."""
    major, minor, patch = (int(p) for p in [*version.split("."), "0", "0"][:3])
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def write_trtexec(folder: Path, generation: str) -> Path:
    """``folder/trtexec`` behaving as trtexec of a release of ``generation`` (see the module
    docstring); it echoes its arguments one per line when it accepts them. With
    ``FAKE_TRTEXEC_REPORT=FILE`` it writes {version, matched, unmatched, uncovered} for
    --layerPrecisions.

    Stricter than trtexec, for hydra-deploy's own rule: a weakly typed reduced-precision build
    (``--fp16``/``--bf16`` without ``--stronglyTyped``) of a graph with decisions
    (``hydra-calibrate --in-graph``) fails, naming them, when a floating-point layer the parser
    makes of a ``decisions/...`` node is not pinned by a ``--layerPrecisions=<layer>:fp32``
    (``uncovered``: tests/helpers/decision_layers.py); the real trtexec would build it with
    those layers in FP16."""
    version, key = RELEASES[generation]
    build = " [b1]" if parse_version(version) >= (11, 0) else ""  # logging.h v11.0 adds the build
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "trtexec"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        f"VERSION = {version!r}\n"
        f"OPTIONS = set({OPTIONS[key]['options']!r}) - {NOT_TRTEXEC.get(key, set())!r}\n"
        f"BANNER = '&&&& RUNNING TensorRT.trtexec [TensorRT v{version_code(version)}]{build} "
        "# trtexec'\n"
        "args = sys.argv[1:]\n"
        "print(BANNER, *args, file=sys.stderr)\n"
        "if '--help' in args or '-h' in args:\n"
        "    print(BANNER + ' --help')\n"
        "    sys.exit(0)\n"
        "unknown = [a for a in args if a.split('=', 1)[0] not in OPTIONS]\n"
        "if unknown:\n"
        "    for arg in unknown:\n"
        "        name, _, value = arg.partition('=')\n"
        "        print(f'[E] Unknown option: {name} {value}', file=sys.stderr)\n"
        "    print('&&&& FAILED TensorRT.trtexec', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        "value = dict(a.split('=', 1) for a in args if '=' in a)\n"
        "pairs = [p.rsplit(':', 1) for p in value.get('--layerPrecisions', '').split(',') if p]\n"
        "names = [p[0] for p in pairs]\n"
        "# weakly typed reduced precision: every float layer of the decisions must be pinned\n"
        "weak = ('--fp16' in args or '--bf16' in args) and '--stronglyTyped' not in args\n"
        "uncovered = []\n"
        "if weak and '--onnx' in value:\n"
        "    from helpers.decision_layers import decision_layers, uncovered_decision_layers\n"
        "    if any(decision_layers(value['--onnx'])):\n"
        "        from helpers.trt_standins import parse_onnx\n"
        "        layers = {l.name for l in parse_onnx(value['--onnx'], VERSION).layers}\n"
        "        fp32 = {p[0] for p in pairs if p[-1] == 'fp32'}\n"
        "        uncovered = uncovered_decision_layers(value['--onnx'], fp32, layers)\n"
        "if os.environ.get('FAKE_TRTEXEC_REPORT'):\n"
        "    from helpers.trt_standins import parse_onnx\n"
        "    layers = {l.name for l in parse_onnx(value['--onnx'], VERSION).layers}\n"
        "    report = {'version': VERSION, 'matched': [n for n in names if n in layers],\n"
        "              'unmatched': [n for n in names if n not in layers], 'uncovered': uncovered}\n"
        "    open(os.environ['FAKE_TRTEXEC_REPORT'], 'w').write(json.dumps(report))\n"
        "if uncovered:\n"
        "    print('[E] decision layers a weakly typed --fp16/--bf16 build leaves to reduced '\n"
        "          'precision (no --layerPrecisions=<layer>:fp32 reaches them): '\n"
        "          + ', '.join(uncovered), file=sys.stderr)\n"
        "    print('&&&& FAILED TensorRT.trtexec', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        "for arg in args:\n"
        "    print(arg)\n",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script


def install(monkeypatch, version: str) -> dict:
    """Install the TensorRT and Polygraphy stand-ins of ``version`` (``tensorrt`` and
    ``polygraphy.backend.trt`` in ``sys.modules``); returns what they record."""
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt_module(version))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", polygraphy_module(version, calls))
    return calls
