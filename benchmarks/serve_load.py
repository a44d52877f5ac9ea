"""Load on hydra-serve: throughput, latency and Triton's dynamic batching, against in-process runs.

Exports a ViT-S/16 at 224x224 with random weights (timm's init; latency does not depend on the
values) as a Hydra of M=3 members keeping 4 of the 6 heads per layer (``HydraSpec.random``, seed
0), batch profile 1/4/8, starts ``hydra-serve`` on it (a subprocess on loopback ports), and sends
a fixed number of single-image requests from 1, 4 and 8 client threads over HTTP, and from 1 and
8 threads over gRPC. Reported per setting: requests/s, p50/p90/p99 latency (ms, client side), and
the server's batch-size histogram (from Triton's statistics: how many executions ran each batch
size) to show the dynamic batcher at work. After the server is stopped, the same export runs
in-process (``load_runner`` + ``ensemble_scores``, what the server's callable does) at batch 1 and
at each batch size the server ran most: the ratios served / in-process say what serving costs
(HTTP/gRPC, serialisation, queueing) and what batching gains. Every served answer is checked
against the in-process one (max abs difference of member logits, equal predictions).

The clients run on the same cores as the server: on a small machine they take a share of the CPU
the in-process run has to itself. Compare the ratios of one run, not times across machines.

Run it from the repository root::

    .venv/bin/python benchmarks/serve_load.py --overwrite
    .venv/bin/python benchmarks/serve_load.py --requests 32 --threads 1 4 --export /tmp/vit_s16-m3

Writes ``benchmarks/results/serve_load.json`` (every number and the environment) and
``serve_load.md`` (the tables and the command). The library part (:class:`ServerProcess`,
:func:`run_load`, :func:`batch_histogram`) is what ``tests/serve/test_serve.py`` drives too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.serve.pytriton_app import OUTPUT_NAMES

RESULTS = Path("benchmarks/results")
DEFAULT_OUT = RESULTS / "serve_load.json"
PROG = ".venv/bin/python benchmarks/serve_load.py"
#: what hydra-serve answers, in its order (member logits, the scores, the prediction)
OUTPUTS = OUTPUT_NAMES
TRITON_DTYPES = {"float32": "FP32", "int64": "INT64", "int32": "INT32", "float16": "FP16"}


# --------------------------------------------------------------------------------------------------
# library part: a hydra-serve subprocess, a load generator, Triton's batch statistics


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now (the OS's pick)."""
    sockets = []
    try:
        for _ in range(count):
            probe = socket.socket()
            probe.bind((host, 0))
            sockets.append(probe)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for probe in sockets:
            probe.close()


def descendants(pid: int) -> list[int]:
    """Process ids of every living descendant of ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def still_running(pids: Sequence[int], within_s: float = 10.0) -> list[int]:
    """The ``pids`` still running after waiting up to ``within_s`` for them to end (the server's
    children, reparented when it exits, finish their own shutdown a moment later)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_running(p)]


@dataclass
class ServerProcess:
    """``hydra-serve EXPORT`` as a subprocess on loopback ports; :meth:`start` waits until ready.

    stdout (the --json line) and stderr (Triton's log) go to files in ``log_dir``, so that a
    chatty server never blocks on a full pipe; :meth:`log_tail` shows stderr on failure.
    """

    export_dir: Path
    log_dir: Path
    extra_args: Sequence[str] = ()
    host: str = "127.0.0.1"
    ports: list[int] = field(default_factory=lambda: free_ports(3))
    process: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports[0]}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports[1]}"

    @property
    def model_name(self) -> str:
        return self.info["model"]

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "hydra_deploy.cli.serve",
            str(self.export_dir),
            "--host",
            self.host,
            "--port",
            str(self.ports[0]),
            "--grpc-port",
            str(self.ports[1]),
            "--metrics-port",
            str(self.ports[2]),
            "--json",
            *self.extra_args,
        ]

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / "stderr.txt"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        import json

        import tritonclient.http as http

        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / "stdout.txt", "wb")  # noqa: SIM115 (the child keeps it)
        err = open(self.log_dir / "stderr.txt", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command(), stdout=out, stderr=err, stdin=subprocess.DEVNULL
        )
        out.close()
        err.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"hydra-serve exited with {self.process.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            if not self.info:
                first = (self.log_dir / "stdout.txt").read_text().partition("\n")
                if first[1]:
                    self.info = json.loads(first[0])
            if self.info:
                with contextlib.suppress(Exception):
                    client = http.InferenceServerClient(self.http_url)
                    try:
                        if client.is_model_ready(self.model_name):
                            return self
                    finally:
                        client.close()
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"hydra-serve was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit; returns the exit code (kills after the timeout)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process is not None else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            for pid in descendants(self.process.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()


def client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    elif protocol == "grpc":
        import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    return module


def infer_once(client, module, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request: ``arrays`` (by input name, with the batch axis) in, every output out."""
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(
            name,
            list(array.shape),
            TRITON_DTYPES.get(array.dtype.name, module.np_to_triton_dtype(array.dtype)),
        )
        tensor.set_data_from_numpy(np.ascontiguousarray(array))
        inputs.append(tensor)
    outputs = [module.InferRequestedOutput(name) for name in OUTPUTS]
    result = client.infer(model, inputs, outputs=outputs)
    return {name: result.as_numpy(name) for name in OUTPUTS}


@dataclass
class LoadRun:
    """What :func:`run_load` measured: per request (in request order) latency and answer."""

    protocol: str
    threads: int
    latencies_ms: list[float]
    answers: list[dict[str, np.ndarray]]
    wall_s: float
    errors: list[str]

    @property
    def count(self) -> int:
        return len(self.latencies_ms)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q))

    def summary(self) -> dict[str, Any]:
        """The run in the report: its setting, counts, wall time, throughput and percentiles."""
        count, wall = self.count, self.wall_s
        return {
            "protocol": self.protocol,
            "client_threads": self.threads,
            "requests": count,
            "errors": len(self.errors),
            "wall_s": round(wall, 3),
            "throughput_rps": round(count / wall, 3) if wall else None,
            "p50_ms": round(self.percentile_ms(50), 2),
            "p90_ms": round(self.percentile_ms(90), 2),
            "p99_ms": round(self.percentile_ms(99), 2),
        }


def run_load(
    url: str,
    model: str,
    requests: Sequence[dict[str, np.ndarray]],
    *,
    threads: int,
    protocol: str = "http",
) -> LoadRun:
    """Send every request of ``requests`` once, from ``threads`` client threads (each its own
    client, taking the next unsent request), and time each (client side, milliseconds)."""
    module = client_module(protocol)
    latencies: list[float | None] = [None] * len(requests)
    answers: list[dict[str, np.ndarray] | None] = [None] * len(requests)
    errors: list[str] = []
    next_index = iter(range(len(requests)))
    lock = threading.Lock()

    def worker() -> None:
        client = module.InferenceServerClient(url)
        try:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                start = time.perf_counter()
                try:
                    answers[index] = infer_once(client, module, model, requests[index])
                except Exception as err:  # counted and reported, the load goes on
                    with lock:
                        errors.append(f"request {index}: {err}")
                    continue
                latencies[index] = (time.perf_counter() - start) * 1000
        finally:
            client.close()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    start = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    wall = time.perf_counter() - start
    done = [i for i, value in enumerate(latencies) if value is not None]
    return LoadRun(
        protocol,
        threads,
        [latencies[i] for i in done],  # type: ignore[misc]
        [answers[i] for i in done],
        wall,
        errors,
    )  # type: ignore[misc]


def batch_histogram(url: str, model: str) -> dict[int, int]:
    """Triton's executions per batch size of ``model`` so far (``get_inference_statistics``)."""
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    histogram: dict[int, int] = {}
    for model_stats in stats.get("model_stats", []):
        for entry in model_stats.get("batch_stats", []):
            count = int(entry.get("compute_infer", {}).get("count", 0))
            if count:
                histogram[int(entry["batch_size"])] = (
                    histogram.get(int(entry["batch_size"]), 0) + count
                )
    return histogram


def server_version(url: str) -> str | None:
    """The Triton server's version (its metadata), or None."""
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    try:
        return client.get_server_metadata().get("version")
    except Exception:
        return None
    finally:
        client.close()


def histogram_delta(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    delta = {size: count - before.get(size, 0) for size, count in after.items()}
    return {size: count for size, count in sorted(delta.items()) if count > 0}


def expected_answers(
    runner, requests: Sequence[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """The in-process answer of each request: ``runner`` + ``ensemble_scores``, batch by batch."""
    from hydra_deploy.uncertainty import ensemble_scores

    answers = []
    for request in requests:
        logits = runner(request)["member_logits"]
        scores = ensemble_scores(logits)
        answer = {"member_logits": logits, "prediction": scores["prediction"]}
        answer.update({name: scores[name] for name in OUTPUTS[1:-1]})
        answers.append(answer)
    return answers


def max_differences(
    served: dict[str, np.ndarray], local: dict[str, np.ndarray]
) -> dict[str, float]:
    """Max abs difference per float output, and 0/1 for whether predictions differ."""
    found = {}
    for name in OUTPUTS:
        got = np.asarray(served[name])
        want = np.asarray(local[name]).reshape(got.shape)  # scores: [B] here, [B, 1] served
        if name == "prediction":
            found[name] = float(not np.array_equal(got, want))
        else:
            found[name] = float(np.max(np.abs(got.astype(np.float64) - want)))
    return found


# --------------------------------------------------------------------------------------------------
# the benchmark


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from common import add_output_options  # as main's: the library part above stays light

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Throughput, latency and dynamic batching of hydra-serve (Triton via "
        "PyTriton) on a ViT-S/16 Hydra, against the same export run in-process.",
        epilog=f"example:\n  {PROG} --overwrite\n  {PROG} --requests 32 --threads 1 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backbone", default="vit_s16", help="timm ViT (default vit_s16)")
    parser.add_argument("--members", type=int, default=3, help="members M (default 3)")
    parser.add_argument(
        "--heads-per-member",
        type=int,
        default=4,
        help="heads kept per layer and member (default 4)",
    )
    parser.add_argument(
        "--batch-profile",
        type=int,
        nargs=3,
        default=[1, 4, 8],
        metavar=("MIN", "OPT", "MAX"),
        help="export batch profile (default 1 4 8)",
    )
    parser.add_argument(
        "--export", type=Path, help="serve this existing export folder instead of exporting one"
    )
    parser.add_argument(
        "--requests", type=int, default=64, help="single-image requests per setting (default 64)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 4, 8],
        help="client threads, HTTP (default 1 4 8)",
    )
    parser.add_argument(
        "--grpc-threads",
        type=int,
        nargs="*",
        default=[1, 8],
        help="client threads, gRPC (default 1 8)",
    )
    parser.add_argument(
        "--queue-delay-us",
        type=int,
        default=2000,
        help="hydra-serve --queue-delay-us (default 2000)",
    )
    parser.add_argument(
        "--rounds", type=int, default=12, help="in-process timed calls per batch size (default 12)"
    )
    add_output_options(
        parser,
        f"JSON output (default {DEFAULT_OUT}); the tables go beside it as .md",
        default=DEFAULT_OUT,
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or min(args.threads + args.grpc_threads) < 1:
        parser.error("--requests, --rounds and thread counts must be >= 1")
    return args


def make_export(args: argparse.Namespace, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The benchmark's export (random weights), or ``--export`` as given."""
    if args.export is not None:
        return args.export, {"export": str(args.export)}
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    torch.manual_seed(0)
    backbone = load_backbone(args.backbone)
    disjoint = args.members * args.heads_per_member <= backbone.num_heads
    spec = HydraSpec.random(
        backbone.name,
        backbone.num_layers,
        backbone.num_heads,
        backbone.head_dim,
        members=args.members,
        heads_per_member=args.heads_per_member,
        disjoint=disjoint,
        seed=0,
    )
    hydra = fuse(backbone, spec)
    out = folder / f"{args.backbone}-m{args.members}"
    export_onnx(hydra, out, batch=tuple(args.batch_profile), validate=False)
    model = {
        "backbone": args.backbone,
        "timm_name": backbone.name,
        "members": args.members,
        "heads_per_member": args.heads_per_member,
        "num_heads": backbone.num_heads,
        "num_layers": backbone.num_layers,
        "disjoint": disjoint,
        "batch_profile": list(args.batch_profile),
        "weights": "random (timm init, seed 0)",
    }
    return out, model


def in_process_rps(runner, example: np.ndarray, batch: int, rounds: int) -> dict[str, float]:
    """Examples per second of ``runner`` + ``ensemble_scores`` at ``batch`` (median call)."""
    from hydra_deploy.uncertainty import ensemble_scores

    x = np.repeat(example, batch, axis=0)
    ensemble_scores(runner(x)["member_logits"])  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        ensemble_scores(runner(x)["member_logits"])
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {
        "batch": batch,
        "call_ms": round(median * 1000, 2),
        "examples_per_s": round(batch / median, 3),
    }


def markdown(result: dict[str, Any], command: str) -> str:
    lines = [
        "# hydra-serve under load",
        "",
        f"{result['model_note']}; served by hydra-serve (Triton {result['server'].get('triton', '?')} "
        f"via PyTriton {result['server'].get('pytriton', '?')}, ONNX Runtime CPU, 1 instance, "
        f"dynamic batcher: max batch {result['server']['max_batch']}, preferred "
        f"{result['server']['preferred_batch']}, queue delay {result['server']['queue_delay_us']} us) "
        f"on {result['machine']['cpu_count']} cores ({result['machine']['cpu_model']}), clients on "
        "the same machine. Single-image requests; latency is client side.",
        "",
        "| protocol | client threads | requests | req/s | p50 ms | p90 ms | p99 ms | server batches (size: count) | served / in-process b1 | served / in-process at main batch | load 1m |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in result["settings"]:
        hist = ", ".join(f"{k}: {v}" for k, v in row["batch_histogram"].items())
        lines.append(
            f"| {row['protocol']} | {row['client_threads']} | {row['requests']} | "
            f"{row['throughput_rps']:.2f} | {row['p50_ms']:.1f} | {row['p90_ms']:.1f} | "
            f"{row['p99_ms']:.1f} | {hist} | {row['ratio_vs_in_process_b1']:.2f} | "
            f"{row['ratio_vs_in_process_main_batch']:.2f} (b{row['main_batch']}) | "
            f"{row['load_average_1m']} |"
        )
    lines += [
        "",
        "In-process (`load_runner` + `ensemble_scores`, same export, server stopped):",
        "",
        "| batch | call ms | examples/s |",
        "|---:|---:|---:|",
    ]
    for row in result["in_process"]:
        lines.append(f"| {row['batch']} | {row['call_ms']:.1f} | {row['examples_per_s']:.2f} |")
    check = result["correctness"]
    lines += [
        "",
        f"Every served answer against the in-process one: max |member_logits diff| "
        f"{check['member_logits']:.2e}, max score diff {check['max_score_diff']:.2e}, "
        f"predictions differing: {int(check['prediction_mismatches'])}; request errors: "
        f"{check['errors']}.",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name, package in (
        ("pytriton", "nvidia-pytriton"),
        ("tritonclient", "tritonclient"),
        ("onnxruntime", "onnxruntime"),
        ("numpy", "numpy"),
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(package)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    from common import load_average, machine, note, refuse_existing

    from hydra_deploy.atomic import atomic_write_json, atomic_write_text
    from hydra_deploy.engines import load_runner

    args = parse_args(argv)
    md_path = refuse_existing(args.out, args.overwrite)
    if md_path is None:
        return 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve_load.") as scratch:
        folder = Path(scratch)
        note(args, "exporting the model ...")
        export_dir, model = make_export(args, folder)
        runner = load_runner(export_dir)
        size = runner.inputs[0].shape[1:]
        rng = np.random.default_rng(0)
        images = rng.standard_normal((16, *size)).astype(np.float32)  # 16 distinct images
        total = max(args.requests, 1)
        requests = [{"pixel_values": images[i % len(images)][None]} for i in range(total)]
        local = expected_answers(runner, [{"pixel_values": im[None]} for im in images])
        settings_plan = [("http", t) for t in args.threads] + [
            ("grpc", t) for t in args.grpc_threads
        ]
        rows, worst = (
            [],
            {"member_logits": 0.0, "max_score_diff": 0.0, "prediction_mismatches": 0, "errors": 0},
        )
        note(args, "starting hydra-serve ...")
        server = ServerProcess(
            Path(export_dir),
            folder / "logs",
            extra_args=["--queue-delay-us", str(args.queue_delay_us)],
        )
        with server:
            info = server.info
            triton_version = server_version(server.http_url)
            warm = run_load(server.http_url, server.model_name, requests[:4], threads=2)
            if warm.errors:
                raise RuntimeError(f"warm-up requests failed: {warm.errors[0]}")
            for protocol, threads in settings_plan:
                url = server.http_url if protocol == "http" else server.grpc_url
                before = batch_histogram(server.http_url, server.model_name)
                run = run_load(url, server.model_name, requests, threads=threads, protocol=protocol)
                histogram = histogram_delta(
                    batch_histogram(server.http_url, server.model_name), before
                )
                for index, answer in enumerate(run.answers):
                    diffs = max_differences(answer, local[index % len(images)])
                    worst["member_logits"] = max(worst["member_logits"], diffs["member_logits"])
                    worst["max_score_diff"] = max(
                        worst["max_score_diff"], *(diffs[n] for n in OUTPUTS[1:-1])
                    )
                    worst["prediction_mismatches"] += int(diffs["prediction"])
                worst["errors"] += len(run.errors)
                row = run.summary()
                row["load_average_1m"] = (load_average() or [None])[
                    0
                ]  # a busy neighbour shows here
                row["batch_histogram"] = {str(k): v for k, v in histogram.items()}
                row["executions"] = sum(histogram.values())
                row["mean_batch"] = round(
                    sum(k * v for k, v in histogram.items()) / max(1, row["executions"]), 2
                )
                # the batch size most requests ran in
                row["main_batch"] = (
                    max(histogram, key=lambda k: k * histogram[k]) if histogram else 1
                )
                rows.append(row)
                note(
                    args,
                    f"{protocol} x{threads}: {row['throughput_rps']:.2f} req/s, p50 "
                    f"{row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, batches {histogram}",
                )
            stop_started = time.perf_counter()
        stop_s = time.perf_counter() - stop_started
        note(args, "in-process runs ...")
        batches = sorted({1, *(row["main_batch"] for row in rows)})
        in_process = [in_process_rps(runner, images[:1], b, args.rounds) for b in batches]
        by_batch = {row["batch"]: row for row in in_process}
        for row in rows:
            row["ratio_vs_in_process_b1"] = round(
                row["throughput_rps"] / by_batch[1]["examples_per_s"], 3
            )
            row["ratio_vs_in_process_main_batch"] = round(
                row["throughput_rps"] / by_batch[row["main_batch"]]["examples_per_s"], 3
            )
        runner.close()
    env = machine()
    env.update(_versions())
    env["load_average"] = load_average()
    model_note = (
        f"{model.get('backbone', export_dir)} Hydra, M={model.get('members', '?')} x "
        f"{model.get('heads_per_member', '?')} heads per layer, random weights"
    )
    server_info = {
        key: info.get(key)
        for key in (
            "max_batch",
            "preferred_batch",
            "queue_delay_us",
            "instances",
            "providers",
            "inputs",
        )
    }
    server_info["pytriton"] = env.get("pytriton")
    server_info["triton"] = triton_version
    server_info["stop_s"] = round(stop_s, 2)
    command = f"{PROG} --requests {args.requests} --threads {' '.join(map(str, args.threads))} --grpc-threads {' '.join(map(str, args.grpc_threads))} --overwrite"
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "model_note": model_note,
        "server": server_info,
        "settings": rows,
        "in_process": in_process,
        "correctness": worst,
        "machine": env,
        "total_s": round(time.perf_counter() - started, 1),
        "command": command,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    text = markdown(result, command)
    atomic_write_text(md_path, text)
    print(text)
    note(args, f"wrote {args.out} and {md_path} ({result['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
