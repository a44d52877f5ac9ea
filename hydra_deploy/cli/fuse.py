"""hydra-fuse: build a Hydra model from a backbone and a spec; print its members, size and cost."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hydra_deploy.cli import common

EXAMPLES = """\
  hydra-fuse --backbone vit_b16 --members 3 --heads-per-member 4
  hydra-fuse --backbone vit_s16 --members 3 --heads-per-member 2 --shared-layers 6 --json
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --spec spec.json
  hydra-fuse --backbone vit_ti16 --members 4 --save-spec spec.json --overwrite
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-fuse",
        "Build a Hydra ensemble of a timm ViT: M members keeping different attention heads, fused "
        "into one network. Prints the members' heads, parameters, MACs and a forward pass's shape. "
        "Without --spec the heads are drawn at random (seeded); importance-based selection "
        "(Taylor, circuit) comes with hydra_deploy.pruning.",
        EXAMPLES,
    )
    p.add_argument(
        "--backbone",
        required=True,
        help="alias (vit_ti16, vit_s16, vit_b16, vit_l16), timm ViT name, or timm/HF folder",
    )
    p.add_argument("--checkpoint", help="local .safetensors/.pth file or folder; 'hub' downloads "
                   "(needs network); omitted: random weights")  # fmt: skip
    p.add_argument(
        "--num-classes", type=int, help="classifier size (default: checkpoint's or timm's)"
    )
    p.add_argument("--spec", type=Path, help="HydraSpec JSON file (instead of a random spec)")
    p.add_argument("--members", "-m", type=int, default=3, help="M, number of members (default 3)")
    p.add_argument(
        "--heads-per-member",
        "-k",
        type=int,
        default=None,
        help="heads each member keeps per layer (default: num_heads // M)",
    )
    p.add_argument(
        "--shared-layers",
        type=int,
        default=0,
        help="leading layers in which all members keep the same heads (a shared trunk)",
    )
    p.add_argument("--disjoint", action="store_true", help="members keep disjoint heads per layer")
    p.add_argument("--seed", type=int, default=0, help="seed of the random spec and the input")
    p.add_argument(
        "--mlp-merge",
        choices=("average", "grouped"),
        default=None,
        help="average: one MLP of the members' mean weights (paper); grouped: own MLPs",
    )
    p.add_argument(
        "--lowering",
        default="bmm",
        choices=("bmm", "loop", "dense", "conv1d", "einsum"),
        help="how grouped projections run (default bmm)",
    )
    p.add_argument(
        "--batch", type=int, default=2, help="batch size of the test forward (default 2)"
    )
    p.add_argument("--save-spec", type=Path, help="write the spec used to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save-spec file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main_body(args: argparse.Namespace) -> int:
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.errors import HydraError
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    if args.batch < 1:
        raise HydraError(f"--batch must be at least 1, got {args.batch}")
    if args.save_spec is not None:
        common.refuse_existing(args.save_spec, args.overwrite)
    backbone = load_backbone(
        args.backbone, checkpoint=args.checkpoint, num_classes=args.num_classes
    )
    if args.spec is not None:
        spec = HydraSpec.from_json(args.spec)
    else:
        k = args.heads_per_member
        if k is None:
            k = max(1, backbone.num_heads // max(args.members, 1))
        spec = HydraSpec.random(
            backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim,
            members=args.members, heads_per_member=k, shared_layers=args.shared_layers,
            disjoint=args.disjoint, seed=args.seed,
        )  # fmt: skip
    hydra = fuse(backbone, spec, args.mlp_merge, lowering=args.lowering)
    x = backbone.example_inputs(args.batch, seed=args.seed)
    with torch.inference_mode():
        hydra(x)  # warm-up: the first call pays for allocations and kernel selection
        start = time.perf_counter()
        logits = hydra(x)
        latency_ms = (time.perf_counter() - start) * 1e3
    if args.save_spec is not None:
        hydra.spec.to_json(args.save_spec)

    single_params = backbone.num_parameters()
    report = {
        "backbone": backbone.name,
        "weights": backbone.weights,
        "spec": hydra.spec.to_dict(),
        "merge": hydra.merge,
        "parameters": {
            "hydra": hydra.num_parameters(),
            "single": single_params,
            "deep_ensemble": spec.num_members * single_params,
        },
        "macs_per_example": hydra.macs,
        "input_shape": list(x.shape),
        "output_shape": list(logits.shape),
        "forward_ms": round(latency_ms, 2),
    }
    if args.json:
        import json

        print(json.dumps(report, indent=2))
        return 0
    if args.quiet:
        return 0
    params, macs = report["parameters"], hydra.macs
    rows = [
        (name, f"{params[name] / 1e6:.2f}", f"{params[name] / single_params:.2f}",
         f"{macs[name] / 1e9:.3f}", f"{macs[name] / macs['single']:.2f}")
        for name in ("single", "hydra", "deep_ensemble")
    ]  # fmt: skip
    print(hydra.spec.summary())
    print()
    print(hydra.summary())
    print()
    print(
        common.print_table(rows, ("model", "params (M)", "x single", "GMACs/example", "x single"))
    )
    print()
    print(f"forward: input {tuple(x.shape)} -> member_logits {tuple(logits.shape)} "
          f"[batch, members, classes] in {latency_ms:.0f} ms (second call)")  # fmt: skip
    if args.save_spec is not None:
        print(f"spec written to {args.save_spec}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return common.run(main_body, args)


if __name__ == "__main__":
    sys.exit(main())
