"""hydra-fuse: build a Hydra model from a backbone and a spec; print its members, size and cost."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.cli import model_options as build
from hydra_deploy.errors import HydraError, counted
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import RunnerOptions, add_options
from hydra_deploy.threads import use_threads

torch = lazy_module("torch", purpose="hydra-fuse", error=HydraError)  # not for --help

EXAMPLES = """\
  hydra-fuse --backbone vit_b16 --members 3 --heads-per-member 4
  hydra-fuse --backbone vit_s16 --members 3 --heads-per-member 2 --shared-layers 6 --json
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --calib train/ \\
             --importance taylor --heads-per-member 4 --finetune train/ --epochs 1 --lr 1e-4 \\
             --finetune-dir members/
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --calib val.npz --ood ood.npz \\
             --importance circuit --keep-ratio 0.33 --save-spec spec.json
  hydra-fuse --backbone vit_b16 --checkpoint vit_b16.safetensors --spec spec.json
  hydra-fuse --backbone hf:models/minilm-wordnet --calib train.tsv --heads-per-member 4 --json
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-fuse",
        "Build a Hydra ensemble of a Transformer classifier (timm ViT, Hugging Face BERT, "
        "OpenCLIP): M members keeping different attention heads, fused "
        "into one network. Heads are drawn at random (seeded), chosen by importance on --calib "
        "data (Taylor or circuit), or read from a spec file; members can be fine-tuned. Prints "
        "the members' heads, parameters, MACs and a forward pass's shape.",
        EXAMPLES,
    )
    build.add_build_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--batch", type=int, default=2, help="batch of the test forward (default 2)")
    out.add_argument("--save-spec", type=Path, help="write the spec used to this JSON file")
    out.add_argument("--overwrite", action="store_true", help="replace an existing --save-spec")
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    add_options(p, RunnerOptions, only=("threads",))
    return p


def main_body(args: argparse.Namespace) -> int:
    use_threads(common.options(RunnerOptions, args).threads, torch=True)
    if args.batch < 1:
        raise HydraError(f"--batch must be at least 1, got {args.batch}")
    if args.save_spec is not None:
        common.refuse_existing(args.save_spec, args.overwrite)
    backbone, spec, members, hydra = build.build_hydra(args, progress=not args.quiet)
    # the fused model's own example inputs, in the order of its forward's arguments: one image
    # tensor [batch, C, H, W], or text's input_ids, attention_mask[, token_type_ids] [batch, seq]
    x = hydra.example_inputs(args.batch, seed=args.seed)
    inputs = x if isinstance(x, tuple) else (x,)
    with torch.inference_mode():
        hydra(*inputs)  # warm-up: the first call pays for allocations and kernel selection
        start = time.perf_counter()
        logits = hydra(*inputs)
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
        "input_shape": list(inputs[0].shape),  # text: [batch, seq] of each input
        "output_shape": list(logits.shape),
        "forward_ms": round(latency_ms, 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if args.quiet:
        return 0
    params, macs = report["parameters"], hydra.macs
    rows = [
        (
            name,
            f"{params[name] / 1e6:.2f}",
            f"{params[name] / single_params:.2f}",
            f"{macs[name] / 1e9:.3f}",
            f"{macs[name] / macs['single']:.2f}",
        )
        for name in ("single", "hydra", "deep_ensemble")
    ]
    print(hydra.spec.summary())
    print()
    print(hydra.summary())
    for entry in report["finetune"] or []:
        print(
            f"member {entry['member']}: fine-tuned {counted(entry['steps'], 'step')}, "
            "training loss "
            f"{entry['loss_before']:.4f} -> {entry['loss_after']:.4f}"
            f"{' (resumed)' if entry.get('resumed') else ''}"
        )
    print()
    print(
        common.print_table(rows, ("model", "params (M)", "x single", "GMACs/example", "x single"))
    )
    print()
    print(
        f"forward: input {tuple(inputs[0].shape)} -> member_logits {tuple(logits.shape)} "
        f"[batch, members, classes] in {latency_ms:.0f} ms (second call)"
    )
    if args.save_spec is not None:
        print(f"spec written to {args.save_spec}")
    return 0


main = common.entry_point(build_parser, main_body, "hydra-fuse")


if __name__ == "__main__":
    sys.exit(main())
