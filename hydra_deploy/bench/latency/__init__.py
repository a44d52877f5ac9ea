"""Latency of a Hydra ensemble against one model and a deep ensemble, on every backend present.

Variants (all built from one backbone with M members keeping k heads per layer):

- ``single``: the model itself (a timm ``VisionTransformer``, a transformers
  ``BertForSequenceClassification``);
- ``hydra``: ``fuse(backbone, HydraSpec.random(..., disjoint=True), shared_trunk=False)`` -- the
  members keep different heads in every layer (disjoint where M x k fits in a layer's heads);
- ``hydra_trunk``: the same with the first ``trunk_layers`` layers identical in all members, fused
  with ``shared_trunk=True`` so that they run once (checked: ``model.trunk_layers``);
- ``fused_deep_ensemble``: M independent models (own weights), each pruned to its own k heads per
  layer (the ``hydra`` spec) and fused with per-member MLPs (``mlp_merge="grouped"``): a deep
  ensemble deployed as ``hydra-export --checkpoint A B C`` deploys it;
- ``deep_ensemble_seq``: M independent models (own weights) run one after another;
- ``deep_ensemble_batched``: the same M models fused into one network,
  ``fuse(members, HydraSpec.full(..., members=M), mlp_merge="grouped")``: one forward for all.

Backends (each one present is measured; absent ones are reported as skipped, with the reason):
``torch`` (eager, CPU, ``torch.inference_mode``), ``ort`` (ONNX Runtime, CPU execution provider;
every variant exported once), ``torch-cuda-bf16`` / ``torch-cuda-fp16`` (CUDA graphs: captured
once per variant and batch, replayed, timed with CUDA events) and ``tensorrt`` (FP16 engines built
with :func:`hydra_deploy.engines.tensorrt.build_engine`, run through the project's runner).

Precisions (``BenchConfig.precisions``) below FP32 on the CPU runtimes: ``int8-dynamic`` and
``int8-static`` on ONNX Runtime (backends ``ort-int8-dynamic``, ``ort-int8-static``: the FP32
exports quantized by :func:`hydra_deploy.export.int8.quantize_export`, static calibrated on random
inputs) and ``bf16`` in PyTorch (``torch-cpu-bf16``: ``torch.autocast("cpu", torch.bfloat16)``;
skipped with the reason on a CPU without BF16 instructions). Each is timed in the same rounds as
its runtime's FP32 variants, and every row of those runtimes gets ``ratio_vs_fp32_single``; the
INT8 single, Hydra and fused-deep-ensemble graphs are profiled (:mod:`.profiling`: which operators
stay in float).

Timing protocol: per backend and batch, ``warmup`` untimed runs of every variant, then ``rounds``
rounds; each round times every variant once, in an order rotated by one each round, and the single
model before every variant and after the last (paired rounds), so machine noise hits each variant
and its reference alike. Reported per variant: the median latency and its spread (quartiles, min,
max, every time), ``ratio_vs_single`` = the median over rounds of (variant time / the mean of the
single model's two runs around it in that round), the analytic FLOPs ratio (multiply-accumulates, ``model.macs``), ``gap`` =
ratio / FLOPs ratio (1.0: the variant runs as fast as its FLOPs predict), MACs per example and the
achieved GMAC/s (to read each time against the hardware's limit). The environment (versions, CPU,
GPU, threads, load average) goes into the result.

This is a build-side module: it imports torch (and, when a backend needs them, onnxruntime, onnx,
TensorRT). Runtime code never imports it.

Modules: :mod:`hydra_deploy.bench.config` (:class:`BenchConfig` and the names it accepts; torch-free), :mod:`.backends` (which
backends can run here; making one by name), :mod:`.variants` (backbones with random weights and
the variants built from them), :mod:`.timing` (the :class:`Timer` and :class:`Backend` interfaces,
the rounds and their summary), :mod:`.torch_backends` (PyTorch eager on the CPU in FP32 and BF16,
CUDA graphs), :mod:`.onnx_backends` (the ONNX export, ONNX Runtime FP32 and INT8, TensorRT),
:mod:`.profiling` (ONNX Runtime's profiler, time per precision), :mod:`.machine` (the environment
of a run, the CPU's BF16 / INT8 instructions), :mod:`.run` (:func:`run_benchmark`), :mod:`.guard` (:func:`check_run`: the check against a
baseline, a regression re-measured before the verdict) and :mod:`.report` (tables, Markdown, the
plot).
"""

from hydra_deploy.bench.config import (
    BACKEND_ALIASES,
    BACKENDS,
    EXPORTERS,
    LOW_PRECISIONS,
    MINILM,
    OPSET,
    PRECISIONS,
    RESULT_FORMAT,
    VARIANTS,
    BenchConfig,
    LowPrecision,
    normalize_backends,
    normalize_precisions,
)
from hydra_deploy.bench.latency.backends import (
    available_backends,
    backend_status,
    make_backend,
    precision_reason,
    resolve_backends,
    resolve_precisions,
)
from hydra_deploy.bench.latency.guard import check_run, remeasure_config
from hydra_deploy.bench.latency.machine import (
    BF16_FEATURES,
    CPU_FEATURES,
    VERSIONED,
    cpu_bf16_reason,
    cpu_features,
    cpu_flags,
    cpu_flags_of,
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
    calibration_feed,
    export_variant,
    feed_of,
    graph_passes,
    int8_unavailable,
    mark_precision,
)
from hydra_deploy.bench.latency.profiling import (
    KernelProfile,
    precision_breakdown,
    precision_of,
    profile_session,
)
from hydra_deploy.bench.latency.report import (
    TABLE_HEADER,
    cpu_features_line,
    describe_run,
    markdown_report,
    markdown_table,
    plot_latency,
    precision_rows,
    profile_rows,
    require_matplotlib,
    table_rows,
    target_reasons,
)
from hydra_deploy.bench.latency.run import (
    Progress,
    max_abs_diff,
    measure_backend,
    measure_backends,
    profile_batch,
    reference_outputs,
    run_benchmark,
)
from hydra_deploy.bench.latency.timing import (
    Backend,
    Timer,
    paired_key,
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
    "BF16_FEATURES",
    "CPU_FEATURES",
    "EXPORTERS",
    "LOW_PRECISIONS",
    "MINILM",
    "OPSET",
    "PRECISIONS",
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
    "KernelProfile",
    "LowPrecision",
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
    "calibration_feed",
    "capture_cuda_graph",
    "check_geometry",
    "check_run",
    "cpu_bf16_reason",
    "cpu_features",
    "cpu_features_line",
    "cpu_flags",
    "cpu_flags_of",
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
    "int8_unavailable",
    "is_text_backbone",
    "load_average",
    "make_backend",
    "mark_precision",
    "markdown_report",
    "markdown_table",
    "max_abs_diff",
    "measure_backend",
    "measure_backends",
    "minilm_folder",
    "normalize_backends",
    "normalize_precisions",
    "paired_key",
    "plain_module",
    "plot_latency",
    "precision_breakdown",
    "precision_of",
    "precision_reason",
    "precision_rows",
    "profile_batch",
    "profile_rows",
    "profile_session",
    "quartiles",
    "random_spec",
    "reference_outputs",
    "remeasure_config",
    "require_matplotlib",
    "resolve_backends",
    "resolve_precisions",
    "resolve_trunk_layers",
    "rotated",
    "run_benchmark",
    "summarize",
    "table_rows",
    "target_reasons",
    "time_rounds",
    "torch_threads",
    "versions",
]
