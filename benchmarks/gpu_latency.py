"""GPU latency in one command: single / Hydra / Hydra shared-trunk / deep ensemble, BF16, CUDA graphs.

Needs only PyTorch with CUDA, timm and this repository (no TensorRT, no ONNX, no network: weights
are random, latency does not depend on them). For ViT-B/16 with M=3 members keeping 4 heads each,
at batch 1, 8 and 64, it times

- ``single``: the timm ViT-B/16;
- ``hydra``: the fused Hydra (disjoint heads; one forward for all members);
- ``hydra_trunk``: Hydra whose first 6 layers are shared and run once;
- ``deep_ensemble_seq``: the 3 full models one after another;
- ``deep_ensemble_batched``: the 3 full models fused into one network;

each in BF16 (weights and activations) captured in a CUDA graph and replayed, timed with CUDA
events (mean of ``--cuda-replays`` replays per timed run; rotating rounds, median over rounds). It
prints a table of milliseconds and ratios to the single model (the paper's claim: Hydra 1.07 x one
model in BF16 on a GPU, a deep ensemble about 3 x) and writes JSON with the GPU name, torch and
CUDA versions. Runs in about a minute on an H200 (well under 3).

Run it from the repository root::

    python benchmarks/gpu_latency.py
    python benchmarks/gpu_latency.py --batch 1 8 64 256 --backend torch-cuda-fp16 --overwrite

Without a CUDA device it stops at once with the reason (exit 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runs from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from hydra_deploy.bench.check import claims  # noqa: E402
from hydra_deploy.cli import bench, common  # noqa: E402

DEFAULTS = {
    "backbone": "vit_b16",
    "batch": [1, 8, 64],
    "backend": ["torch-cuda-bf16"],
    "rounds": 20,
    "warmup": 3,
    "out": Path("benchmarks/results/gpu_latency.json"),
}


def cuda_missing() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) "
        "sees no GPU; run this on a machine with an NVIDIA GPU and a CUDA build of PyTorch"
    )


def body(args) -> int:
    reason = cuda_missing()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return common.EXIT_ERROR
    config, result, baseline = bench.measure(args)
    for claim in claims(result, max_gap=1.10, gap_batch=8):
        verdict = "PASS" if claim["passed"] else "FAIL"
        print(
            f"{claim['backend']} batch {claim['batch']}: {claim['claim']}: {verdict} "
            f"({claim['detail']})"
        )
    gpu = result["environment"]["gpu"]
    print(
        f"{gpu['name']} (SM {gpu['compute_capability']}), torch {result['environment']['torch_build']}, "
        f"CUDA {gpu['cuda']}; wall time {result['wall_time_s']:.0f} s"
    )
    return bench.finish(args, config, result, baseline)


def main(argv: list[str] | None = None) -> int:
    args = bench.build_parser(prog="python benchmarks/gpu_latency.py", **DEFAULTS).parse_args(argv)
    return common.run(body, args)


if __name__ == "__main__":
    sys.exit(main())
