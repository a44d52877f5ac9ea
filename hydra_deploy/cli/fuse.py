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
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --data train/ --method taylor \\
             --heads-per-member 4 --finetune-epochs 1 --lr 1e-4 --finetune-dir members/
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --data val.npz \\
             --ood-data ood.npz --method circuit --keep-ratio 0.33 --save-spec spec.json
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --spec spec.json
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-fuse",
        "Build a Hydra ensemble of a timm ViT: M members keeping different attention heads, fused "
        "into one network. Heads are drawn at random (seeded), chosen by importance on your data "
        "(Taylor or circuit), or read from a spec file; Taylor members can be fine-tuned. Prints "
        "the members' heads, parameters, MACs and a forward pass's shape.",
        EXAMPLES,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--backbone",
        required=True,
        help="alias (vit_ti16, vit_s16, vit_b16, vit_l16), timm ViT name or folder",
    )
    model.add_argument(
        "--checkpoint",
        help="local .safetensors/.pth file or folder; 'hub' "
        "downloads (needs network); omitted: random weights",
    )
    model.add_argument(
        "--num-classes", type=int, help="classifier size (default: the checkpoint's, else timm's)"
    )

    members = p.add_argument_group("members")
    members.add_argument(
        "--spec", type=Path, help="HydraSpec JSON file (instead of choosing heads)"
    )
    members.add_argument("--members", "-m", type=int, default=3, help="M (default 3)")
    members.add_argument(
        "--heads-per-member",
        "-k",
        type=int,
        help="heads each member keeps per layer (default: num_heads // M)",
    )
    members.add_argument(
        "--keep-ratio",
        type=float,
        help="fraction of each layer's heads a member keeps (instead of -k)",
    )
    members.add_argument(
        "--method",
        choices=("random", "taylor", "circuit"),
        default=None,
        help="how heads are chosen (default: taylor with --data, else random)",
    )
    members.add_argument(
        "--data",
        help="labelled data: image folder (class per sub-folder) or "
        ".npz with x/y (preprocessed float inputs, int labels)",
    )
    members.add_argument("--ood-data", help="OOD inputs for --objective ood: image folder or .npz")
    members.add_argument(
        "--objective",
        choices=("loss", "ood"),
        help="circuit objective (default: ood with --ood-data, else loss)",
    )
    members.add_argument(
        "--temperature",
        type=float,
        default=0.5,
        help="0: each member keeps its top heads; higher: more diverse draws",
    )
    members.add_argument(
        "--max-examples", type=int, default=512, help="examples used to score heads (default 512)"
    )
    members.add_argument(
        "--shared-layers",
        type=int,
        default=0,
        help="random heads: leading layers all members share (a shared trunk)",
    )
    members.add_argument(
        "--disjoint",
        action="store_true",
        help="random heads: members keep disjoint heads per layer",
    )
    members.add_argument(
        "--seed", type=int, default=0, help="seed of everything random (also random weights)"
    )

    tune = p.add_argument_group("fine-tuning (needs --data)")
    tune.add_argument(
        "--finetune-epochs",
        type=float,
        default=0.0,
        help="fine-tune each member for this many epochs (default 0: no)",
    )
    tune.add_argument("--finetune-steps", type=int, help="stop each member after this many steps")
    tune.add_argument("--lr", type=float, default=1e-4, help="fine-tuning learning rate")
    tune.add_argument("--finetune-batch-size", type=int, default=32)
    tune.add_argument(
        "--finetune-dir", type=Path, help="save members here and resume from them on a later run"
    )

    fusion = p.add_argument_group("fusion and output")
    fusion.add_argument(
        "--mlp-merge",
        choices=("average", "grouped"),
        default=None,
        help="average: one MLP of the members' mean weights (paper); "
        "grouped: every member keeps its own MLP",
    )
    fusion.add_argument(
        "--lowering",
        default="bmm",
        choices=("bmm", "loop", "dense", "conv1d", "einsum"),
        help="how grouped projections run (default bmm)",
    )
    fusion.add_argument(
        "--batch", type=int, default=2, help="batch of the test forward (default 2)"
    )
    fusion.add_argument("--save-spec", type=Path, help="write the spec used to this JSON file")
    fusion.add_argument("--overwrite", action="store_true", help="replace an existing --save-spec")
    fusion.add_argument("--json", action="store_true", help="print the report as JSON")
    return p  # fmt: skip


def choose_spec(args: argparse.Namespace, backbone):
    """The HydraSpec the arguments ask for: read, drawn at random, or selected on data."""
    from hydra_deploy.errors import HydraError
    from hydra_deploy.pruning import select_members
    from hydra_deploy.specs import HydraSpec

    if args.spec is not None:
        return HydraSpec.from_json(args.spec)
    method = args.method or ("taylor" if args.data else "random")
    if method != "random" and not args.data:
        raise HydraError(f"--method {method} needs --data (an image folder or .npz with x/y)")
    if method != "random" and (args.shared_layers or args.disjoint):
        raise HydraError("--shared-layers and --disjoint apply to --method random only")
    k = args.heads_per_member
    if k is None and args.keep_ratio is None:
        k = max(1, backbone.num_heads // max(args.members, 1))
    if method == "random" and args.keep_ratio is None:
        return HydraSpec.random(
            backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim,
            members=args.members, heads_per_member=k, shared_layers=args.shared_layers,
            disjoint=args.disjoint, seed=args.seed,
        )  # fmt: skip
    return select_members(
        backbone, args.members, heads_per_member=k, keep_ratio=args.keep_ratio, method=method,
        data=args.data, ood_data=args.ood_data, seed=args.seed, objective=args.objective,
        temperature=args.temperature, max_examples=args.max_examples,
    )  # fmt: skip


def main_body(args: argparse.Namespace) -> int:
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.errors import HydraError
    from hydra_deploy.fusion import fuse

    if args.batch < 1:
        raise HydraError(f"--batch must be at least 1, got {args.batch}")
    if args.save_spec is not None:
        common.refuse_existing(args.save_spec, args.overwrite)
    torch.manual_seed(args.seed)  # random weights (no checkpoint) are reproducible too
    backbone = load_backbone(
        args.backbone, checkpoint=args.checkpoint, num_classes=args.num_classes
    )
    spec = choose_spec(args, backbone)
    members = backbone
    if args.finetune_epochs > 0 or args.finetune_steps:
        from hydra_deploy.pruning import finetune_members

        if not args.data:
            raise HydraError("fine-tuning needs --data (an image folder or .npz with x/y)")
        members = finetune_members(
            backbone, spec, args.data, epochs=args.finetune_epochs or 1.0, lr=args.lr,
            batch_size=args.finetune_batch_size, max_steps=args.finetune_steps, seed=args.seed,
            save_dir=args.finetune_dir, progress=not (args.quiet or args.json),
        )  # fmt: skip
    hydra = fuse(members, spec, args.mlp_merge, lowering=args.lowering)
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
        "finetune": getattr(members, "history", None),
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
    if report["finetune"]:
        for entry in report["finetune"]:
            print(f"member {entry['member']}: fine-tuned {entry['steps']} steps, training loss "
                  f"{entry['loss_before']:.4f} -> {entry['loss_after']:.4f}"
                  f"{' (resumed)' if entry.get('resumed') else ''}")  # fmt: skip
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
