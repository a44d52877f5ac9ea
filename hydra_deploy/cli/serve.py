"""hydra-serve: a live Triton server (HTTP, gRPC, metrics) for an export folder, via PyTriton."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from hydra_deploy.cli import common
from hydra_deploy.errors import ServeError, counted
from hydra_deploy.optional import install_hint
from hydra_deploy.options import RunnerOptions, add_options, spelling
from hydra_deploy.serve.pytriton_app import HydraServer, ServeConfig

EXAMPLES = """\
  hydra-serve export/vit_b16-m3                      # HTTP :8000, gRPC :8001, metrics :8002
  hydra-serve export/vit_b16-m3 --host 0.0.0.0 --port 9000 --instances 2 --threads 4
  hydra-serve export/vit_b16-m3 --max-batch 16 --preferred-batch 8 16 --queue-delay-us 2000
  hydra-serve export/minilm-m3 --model-name minilm --providers cuda,cpu --json --quiet
  hydra-serve export/vit_b16-m3 --raw          # a calibrated export: scores only, no decisions
"""


DESCRIPTION = (
    "Serve a Hydra export with NVIDIA Triton Inference Server (through PyTriton) until "
    "Ctrl-C / SIGTERM. One model, named after the export folder, answers every example's "
    "member_logits [M, C], probs [C], msp, predictive_entropy, expected_entropy, "
    "mutual_information, disagreement ([1] float32 each) and prediction ([1] int64), computed "
    "by ONNX Runtime (or TensorRT for an engine file) and hydra-deploy's ensemble scores. "
    "An export calibrated with hydra-calibrate also answers its decisions: calibrated_probs "
    "[C] and confidence [1] (float32), and for the rules it holds prediction_set [C], accept "
    "[1] and ood_flag [1] (bool); prediction is then the calibrated argmax (--raw: scores "
    "only). Triton's dynamic batcher gathers concurrent requests into batches up to "
    f"--max-batch. Needs {install_hint('pytriton')}. Triton's own log goes to stderr."
)

RAW_HELP = {
    "raw": "serve the scores only: leave out the decisions of a calibrated export "
    "(hydra-calibrate), and do not check them against the model file"
}


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("hydra-serve", DESCRIPTION, EXAMPLES)
    p.add_argument(
        "export_dir",
        type=Path,
        metavar="EXPORT_DIR",
        help="export folder (hydra-export --out), or a .onnx / engine file",
    )
    add_options(p, ServeConfig)
    add_options(p, RunnerOptions, only=("raw",), helps=RAW_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="once ready, print the served model (endpoints, inputs, outputs, "
        "batching) as one JSON line on stdout",
    )
    return p


class _TritonLog:
    """Where Triton's log lines go: stderr (or nowhere with --quiet), the last ones kept."""

    def __init__(self, quiet: bool, keep: int = 200) -> None:
        self.quiet = quiet
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._partial = ""

    def write(self, text: str) -> int:
        if not self.quiet:
            sys.stderr.write(text)
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines.extend(line for line in done if line.strip())
        return len(text)

    def flush(self) -> None:
        if not self.quiet:
            sys.stderr.flush()

    def errors(self, count: int = 3) -> list[str]:
        """The last error lines (Triton's ``E...`` lines, Python errors), most recent last."""
        found = [
            line.strip()
            for line in self.lines
            if line.startswith("E") or "Error" in line or "error:" in line
        ]
        return [line[:300] for line in found[-count:]]


@contextlib.contextmanager
def _triton_log_to(sink: _TritonLog) -> Iterator[TextIO]:
    """PyTriton prints the Triton server's output on ``sys.stdout``; send it to ``sink`` so that
    stdout carries only what hydra-serve prints (its --json line). Yields the real stdout."""
    real = sys.stdout
    with contextlib.redirect_stdout(sink):  # type: ignore[type-var]
        yield real


def _summary(info: dict) -> str:
    inputs = ", ".join(f"{t['name']} {t['dims']} {t['dtype']}" for t in info["inputs"])
    endpoints = info["endpoints"]
    decisions = info.get("decisions")
    answers = ""
    if decisions is not None:
        names = [t["name"] for t in info["outputs"]]
        served = [n for n in ("prediction_set", "accept", "ood_flag") if n in names]
        answers = (
            f"  decisions: calibrated_probs, confidence{''.join(', ' + n for n in served)} "
            f"(T = {decisions['temperature']:.3g}; --raw: scores only)\n"
        )
    return (
        f"serving {info['model']!r} ({info['family'] or 'model'}; {inputs}) from {info['export']}\n"
        + answers
        + f"  HTTP {endpoints['http']}  gRPC {endpoints['grpc']}  metrics {endpoints['metrics']}\n"
        f"  max batch {info['max_batch']}, preferred {info['preferred_batch']}, queue delay "
        f"{info['queue_delay_us']} us, {counted(info['instances'], 'instance')}, "
        f"{', '.join(info['providers'])}; Ctrl-C to stop"
    )


def main_body(args: argparse.Namespace) -> int:
    raw = common.options(RunnerOptions, args).raw
    config = common.options(ServeConfig, args, export_dir=args.export_dir, decisions=not raw)
    with common.flags_named(spelling(ServeConfig)):
        server = HydraServer(config)  # every check; nothing started yet
    log = _TritonLog(quiet=args.quiet)
    try:
        with _triton_log_to(log) as stdout:
            try:
                server.start()
            except ServeError as err:
                details = log.errors(1)
                if not args.quiet:
                    where = "; Triton's log is above"
                else:
                    where = f"; Triton's last error: {details[0]}" if details else ""
                raise ServeError(f"{err}{where}") from err
            info = server.describe()
            if args.json:
                print(json.dumps(info), file=stdout, flush=True)
            elif not args.quiet:
                print(_summary(info), file=stdout, flush=True)
            server.serve_forever()
    finally:
        server.close()
    if not args.quiet:
        print("stopped", file=sys.stderr)
    return 0


main = common.entry_point(build_parser, main_body, "hydra-serve")


if __name__ == "__main__":
    sys.exit(main())
