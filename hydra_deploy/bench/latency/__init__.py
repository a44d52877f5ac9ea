"""Latency of a Hydra ensemble against one model and a deep ensemble, on every backend present.

Variants (all built from one backbone with M members keeping k heads per layer):

- ``single``: the model itself (a timm ``VisionTransformer``, a transformers
  ``BertForSequenceClassification``);
- ``hydra``: ``fuse(backbone, HydraSpec.random(..., disjoint=True), shared_trunk=False)`` -- the
  members keep different heads in every layer (disjoint where M x k fits in a layer's heads);
- ``hydra_trunk``: the same with the first ``trunk_layers`` layers identical in all members, fused
  with ``shared_trunk=True`` so that they run once (checked: ``model.trunk_layers``);
- ``deep_ensemble_seq``: M independent models (own weights) run one after another;
- ``deep_ensemble_batched``: the same M models fused into one network,
  ``fuse(members, HydraSpec.full(..., members=M), mlp_merge="grouped")``: one forward for all.

Backends (each one present is measured; absent ones are reported as skipped, with the reason):
``torch`` (eager, CPU, ``torch.inference_mode``), ``ort`` (ONNX Runtime, CPU execution provider;
every variant exported once), ``torch-cuda-bf16`` / ``torch-cuda-fp16`` (CUDA graphs: captured
once per variant and batch, replayed, timed with CUDA events) and ``tensorrt`` (FP16 engines built
with :func:`hydra_deploy.engines.tensorrt.build_engine`, run through the project's runner).

Timing protocol: per backend and batch, ``warmup`` untimed runs of every variant, then ``rounds``
rounds; each round times every variant once, in an order rotated by one each round, so machine
noise hits all variants alike. Reported per variant: the median latency and its spread (quartiles,
min, max, every time), ``ratio_vs_single`` = the median over rounds of (variant time / single time
in the same round), the analytic FLOPs ratio (multiply-accumulates, ``model.macs``), ``gap`` =
ratio / FLOPs ratio (1.0: the variant runs as fast as its FLOPs predict), MACs per example and the
achieved GMAC/s (to read each time against the hardware's limit). The environment (versions, CPU,
GPU, threads, load average) goes into the result.

This is a build-side module: it imports torch (and, when a backend needs them, onnxruntime, onnx,
TensorRT). Runtime code never imports it.

Modules: :mod:`.config` (:class:`BenchConfig` and the names it accepts), :mod:`.backends` (which
backends can run here; making one by name), :mod:`.variants` (backbones with random weights and
the variants built from them), :mod:`.timing` (the :class:`Timer` and :class:`Backend` interfaces,
the rounds and their summary), :mod:`.torch_backends` (PyTorch eager on the CPU, CUDA graphs),
:mod:`.onnx_backends` (the ONNX export, ONNX Runtime, TensorRT), :mod:`.machine` (the environment
of a run), :mod:`.run` (:func:`run_benchmark`) and :mod:`.report` (tables, Markdown, the plot).
"""

from hydra_deploy.bench.latency.backends import (
    available_backends,
    backend_status,
    make_backend,
    resolve_backends,
)
from hydra_deploy.bench.latency.config import (
    BACKEND_ALIASES,
    BACKENDS,
    EXPORTERS,
    MINILM,
    OPSET,
    RESULT_FORMAT,
    VARIANTS,
    BenchConfig,
    normalize_backends,
)
from hydra_deploy.bench.latency.machine import (
    VERSIONED,
    cpu_model,
    environment,
    gpu_info,
    load_average,
    torch_threads,
    versions,
)
from hydra_deploy.bench.latency.onnx_backends import (
    ExportingBackend,
    OrtBackend,
    OrtTimer,
    TensorRTBackend,
    TensorRTTimer,
    export_variant,
    feed_of,
    graph_passes,
    mark_precision,
)
from hydra_deploy.bench.latency.report import (
    TABLE_HEADER,
    describe_run,
    markdown_report,
    markdown_table,
    plot_latency,
    require_matplotlib,
    table_rows,
)
from hydra_deploy.bench.latency.run import (
    Progress,
    max_abs_diff,
    measure_backend,
    reference_outputs,
    run_benchmark,
)
from hydra_deploy.bench.latency.timing import (
    Backend,
    Timer,
    quartiles,
    rotated,
    summarize,
    time_rounds,
)
from hydra_deploy.bench.latency.torch_backends import (
    CudaEagerTimer,
    CudaGraphBackend,
    CudaGraphTimer,
    TorchBackend,
    TorchTimer,
    capture_cuda_graph,
)
from hydra_deploy.bench.latency.variants import (
    BertLogits,
    Variant,
    VariantSet,
    backbone_factory,
    build_variants,
    check_geometry,
    dynamic_axes,
    ensemble_variants,
    example_inputs,
    input_names,
    is_text_backbone,
    minilm_folder,
    plain_module,
    random_spec,
    resolve_trunk_layers,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ALIASES",
    "EXPORTERS",
    "MINILM",
    "OPSET",
    "RESULT_FORMAT",
    "TABLE_HEADER",
    "VARIANTS",
    "VERSIONED",
    "Backend",
    "BenchConfig",
    "BertLogits",
    "CudaEagerTimer",
    "CudaGraphBackend",
    "CudaGraphTimer",
    "ExportingBackend",
    "OrtBackend",
    "OrtTimer",
    "Progress",
    "TensorRTBackend",
    "TensorRTTimer",
    "Timer",
    "TorchBackend",
    "TorchTimer",
    "Variant",
    "VariantSet",
    "available_backends",
    "backbone_factory",
    "backend_status",
    "build_variants",
    "capture_cuda_graph",
    "check_geometry",
    "cpu_model",
    "describe_run",
    "dynamic_axes",
    "ensemble_variants",
    "environment",
    "example_inputs",
    "export_variant",
    "feed_of",
    "gpu_info",
    "graph_passes",
    "input_names",
    "is_text_backbone",
    "load_average",
    "make_backend",
    "mark_precision",
    "markdown_report",
    "markdown_table",
    "max_abs_diff",
    "measure_backend",
    "minilm_folder",
    "normalize_backends",
    "plain_module",
    "plot_latency",
    "quartiles",
    "random_spec",
    "reference_outputs",
    "require_matplotlib",
    "resolve_backends",
    "resolve_trunk_layers",
    "rotated",
    "run_benchmark",
    "summarize",
    "table_rows",
    "time_rounds",
    "torch_threads",
    "versions",
]
