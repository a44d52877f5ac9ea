"""hydra-serve: a live Triton server (PyTriton) answers what load_runner + ensemble_scores answer.

One server per export, started as a real ``hydra-serve`` subprocess on free loopback ports and
driven through tritonclient's HTTP and gRPC clients. The vision server is shared by the tests of
this module and stopped (SIGINT) by the last one; the text server lives inside its one test.
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.members import random_spec
from helpers.vit import tiny_vit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_load

from hydra_deploy.cli.serve import main
from hydra_deploy.engines import load_runner
from hydra_deploy.errors import ServeError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import SCALAR_SCORES, ensemble_scores

CLASSES = ["ant", "bee", "cat", "dog", "eel"]
ATOL = 1e-5
OUTPUTS_RAW = ("member_logits", "probs", *SCALAR_SCORES, "prediction")


def _serving_available() -> str | None:
    """Why hydra-serve cannot run here, or None."""
    try:
        import tritonclient.grpc
        import tritonclient.http  # noqa: F401

        from hydra_deploy.serve.pytriton_app import check_python_supported, prefer_own_libpython

        check_python_supported()
        prefer_own_libpython({})
    except ImportError as err:
        return f"tritonclient is not installed ({err}): pip install 'hydra-deploy[serve]'"
    except ServeError as err:
        return str(err)
    if not sys.platform.startswith("linux"):
        return "PyTriton runs on Linux only"
    return None


UNAVAILABLE = _serving_available()
needs_server = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no Triton here: {UNAVAILABLE}")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("serve") / "tiny vit+m3"  # not a Triton name: sanitised
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    return out


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    if UNAVAILABLE is not None:
        pytest.skip(reason=f"no Triton here: {UNAVAILABLE}")
    process = serve_load.ServerProcess(export_dir, tmp_path_factory.mktemp("server-logs"))
    process.start(timeout_s=120)
    yield process
    process.stop()
    process.kill()


def images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, 16, 16)).astype(np.float32)


def expected(export_dir, x) -> dict[str, np.ndarray]:
    logits = load_runner(export_dir)(x)["member_logits"]
    return {**ensemble_scores(logits), "member_logits": logits}


def assert_answer(served: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    batch = len(want["prediction"])
    assert served["member_logits"].shape == want["member_logits"].shape
    assert served["member_logits"].dtype == np.float32
    assert served["probs"].shape == (batch, len(CLASSES))
    for name in ("member_logits", "probs"):
        np.testing.assert_allclose(served[name], want[name], atol=ATOL, rtol=0, err_msg=name)
    for name in SCALAR_SCORES:
        assert served[name].shape == (batch, 1) and served[name].dtype == np.float32, name
        np.testing.assert_allclose(served[name][:, 0], want[name], atol=ATOL, rtol=0, err_msg=name)
    assert served["prediction"].shape == (batch, 1) and served["prediction"].dtype == np.int64
    np.testing.assert_array_equal(served["prediction"][:, 0], want["prediction"])


def client(server, protocol: str):
    module = serve_load.client_module(protocol)
    url = server.http_url if protocol == "http" else server.grpc_url
    return module, module.InferenceServerClient(url)


# --- the served model ------------------------------------------------------------------------------
@needs_server
def test_concurrent_requests_over_http_and_grpc_equal_the_runner(server, export_dir):
    assert server.model_name == "tiny_vit_m3"  # the folder name in Triton's characters
    batches = [images(1 + i % 4, seed=i) for i in range(24)]  # batch sizes 1..4
    answers: dict[int, dict] = {}
    failures: list[str] = []

    def worker(offset: int, protocol: str) -> None:
        module, c = client(server, protocol)
        try:
            for index in range(offset, len(batches), 4):
                arrays = {"pixel_values": batches[index]}
                answers[index] = serve_load.infer_once(c, module, server.model_name, arrays)
        except Exception as err:  # reported below
            failures.append(f"{protocol}: {err}")
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(i, ("http", "grpc")[i % 2])) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures[0]
    assert sorted(answers) == list(range(len(batches)))
    for index, x in enumerate(batches):
        assert_answer(answers[index], expected(export_dir, x))


@needs_server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batches_above_the_max_are_refused_and_serving_goes_on(server, export_dir, protocol):
    module, c = client(server, protocol)
    with contextlib.closing(c):
        with pytest.raises(Exception, match="batch-size must be <= 4"):
            serve_load.infer_once(c, module, server.model_name, {"pixel_values": images(5, 0)})
        x = images(4, 1)
        assert_answer(
            serve_load.infer_once(c, module, server.model_name, {"pixel_values": x}),
            expected(export_dir, x),
        )


@needs_server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_a_clean_error_and_serving_goes_on(server, export_dir, protocol):
    module, c = client(server, protocol)
    nan = images(2, 2)
    nan[1, 0, 3, 3] = np.nan
    cases = {
        "NaN": (
            {"pixel_values": nan},
            "RunnerError: input 'pixel_values' holds NaN or infinite values in 1 of 2",
        ),
        "shape": (
            {"pixel_values": images(1, 3)[:, :, :8]},
            "unexpected shape for input 'pixel_values'",
        ),
        "dtype": ({"pixel_values": images(1, 3).astype(np.float64)}, "data-type is 'FP64'"),
        "name": ({"pixels": images(1, 3)}, "unexpected inference input 'pixels'"),
    }
    with contextlib.closing(c):
        for case, (arrays, message) in cases.items():
            with pytest.raises(module.InferenceServerException) as caught:
                serve_load.infer_once(c, module, server.model_name, arrays)
            assert message in str(caught.value), (case, str(caught.value)[-600:])
        x = images(3, 4)
        assert_answer(
            serve_load.infer_once(c, module, server.model_name, {"pixel_values": x}),
            expected(export_dir, x),
        )
        assert c.is_server_live() and c.is_model_ready(server.model_name)


@needs_server
def test_model_config_declares_the_dynamic_batcher_and_the_outputs(server):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    c = http.InferenceServerClient(server.http_url)
    with contextlib.closing(c):
        config = c.get_model_config(server.model_name)
        metadata = c.get_model_metadata(server.model_name)
    assert config["max_batch_size"] == 4  # the export's batch profile max
    assert config["dynamic_batching"]["preferred_batch_size"] == [2, 4]  # profile opt and max
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 1000
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("pixel_values", "TYPE_FP32", [3, 16, 16])
    ]
    dims = {o["name"]: [int(d) for d in o["dims"]] for o in config["output"]}
    assert dims == {
        "member_logits": [3, 5],
        "probs": [5],
        "msp": [1],
        "predictive_entropy": [1],
        "expected_entropy": [1],
        "mutual_information": [1],
        "disagreement": [1],
        "prediction": [1],
    }
    assert {o["name"]: o["datatype"] for o in metadata["outputs"]}["prediction"] == "INT64"
    g = grpc.InferenceServerClient(server.grpc_url)
    with contextlib.closing(g):
        assert g.get_model_config(server.model_name, as_json=True)["config"]["max_batch_size"] == 4
    assert server.info["endpoints"]["http"] == f"http://{server.http_url}"
    assert server.info["max_batch"] == 4 and server.info["instances"] == 1


@needs_server
def test_bounded_load_all_answers_correct(server, export_dir):
    x = images(8, 5)
    requests = [{"pixel_values": x[i % 8][None]} for i in range(48)]
    local = serve_load.expected_answers(load_runner(export_dir), requests[:8])
    before = serve_load.batch_histogram(server.http_url, server.model_name)
    run = serve_load.run_load(server.http_url, server.model_name, requests, threads=4)
    assert not run.errors, run.errors[0]
    assert run.count == 48 and len(run.answers) == 48
    for index, answer in enumerate(run.answers):
        diffs = serve_load.max_differences(answer, local[index % 8])
        assert diffs["prediction"] == 0 and max(diffs.values()) <= ATOL, (index, diffs)
    summary = run.summary()
    assert summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"]
    assert summary["throughput_rps"] > 0 and summary["requests"] == 48
    after = serve_load.batch_histogram(server.http_url, server.model_name)
    histogram = serve_load.histogram_delta(after, before)
    assert sum(size * count for size, count in histogram.items()) == 48  # every image ran once
    assert max(histogram) <= 4


# --- the inference callable, in-process ----------------------------------------------------------------
def test_infer_callable_splits_answers_and_names_the_bad_request_of_a_batch(export_dir):
    pytest.importorskip(
        "pytriton", reason="PyTriton is not installed: pip install 'hydra-deploy[serve]'"
    )
    from pytriton.proxy.types import Request

    from hydra_deploy.errors import RunnerError
    from hydra_deploy.serve.pytriton_app import make_infer_func

    runner = load_runner(export_dir)
    infer = make_infer_func(runner)
    x = images(3, 6)
    answers = infer([Request(data={"pixel_values": x[:1]}), Request(data={"pixel_values": x[1:]})])
    assert [a["msp"].shape for a in answers] == [(1, 1), (2, 1)]  # one answer per request
    want = expected(export_dir, x)
    assert_answer({k: np.concatenate([a[k] for a in answers]) for k in answers[0]}, want)
    bad = x.copy()
    bad[2, 1, 0, 0] = np.inf
    with pytest.raises(
        RunnerError,
        match=r"request\(s\) 2 of the 2 requests batched together are refused .* holds NaN or infinite values in 1 of 2",
    ):
        infer([Request(data={"pixel_values": x[:1]}), Request(data={"pixel_values": bad[1:]})])
    with pytest.raises(RunnerError, match="holds NaN or infinite values in 1 of 1") as caught:
        infer([Request(data={"pixel_values": bad[2:]})])
    assert "batched together" not in str(caught.value)  # alone: the runner's message as it is


# --- the command line: refusals before anything starts ---------------------------------------------
def invoke(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_bad_arguments_are_refused_with_one_line(export_dir, tmp_path):
    ports = [str(p) for p in serve_load.free_ports(3)]
    free = ["--port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    cases = [
        ((str(export_dir), "--port", "70000"), "--port 70000 is not a TCP port"),
        (
            (str(export_dir), *free, "--instances", "0"),
            "--instances must be an integer >= 1, got 0",
        ),
        ((str(export_dir), *free, "--model-name", "a/b"), "is not a Triton model name"),
        ((str(export_dir), "--port", ports[0], "--grpc-port", ports[0]), "three different ports"),
    ]
    if UNAVAILABLE is None:  # these load the export first
        cases += [
            ((str(tmp_path / "missing"), *free), "does not exist"),
            ((str(export_dir), *free, "--max-batch", "8"), "above the export's maximum batch 4"),
            (
                (str(export_dir), *free, "--preferred-batch", "2", "8"),
                "--preferred-batch 8 is above the max batch 4",
            ),
            ((str(tmp_path), *free), "is not an export folder"),
        ]
    for argv, message in cases:
        code, out, err = invoke(*argv)
        assert code == 1 and err.startswith("error: ") and message in err, (argv, err)
        assert err.count("\n") == 1 and not out, (argv, err)
    code, _, err = invoke(str(export_dir), "--port", "eighty")
    assert code == 2 and "invalid int value" in err


def test_without_pytriton_the_install_is_named(export_dir, monkeypatch):
    for name in ("pytriton", "pytriton.triton"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    ports = [str(p) for p in serve_load.free_ports(3)]
    code, _, err = invoke(
        str(export_dir), "--port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]
    )
    assert code == 1 and "pip install 'hydra-deploy[serve]'" in err and err.count("\n") == 1


def test_a_port_in_use_is_named_with_its_flag(export_dir):
    ports = serve_load.free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        code, _, err = invoke(
            str(export_dir),
            "--port",
            str(ports[0]),
            "--grpc-port",
            str(ports[1]),
            "--metrics-port",
            str(ports[2]),
        )
    assert code == 1 and f"port {ports[1]} on 127.0.0.1 is not free" in err
    assert "--grpc-port" in err and err.count("\n") == 1


def test_model_names_and_libpython_path(tmp_path):
    from hydra_deploy.serve.pytriton_app import default_model_name, sanitize_model_name

    assert sanitize_model_name("vit_b16-m3") == "vit_b16-m3"
    assert sanitize_model_name("my model (v2)") == "my_model_v2"
    assert sanitize_model_name("...") == "hydra"
    (tmp_path / "ex.port").mkdir()
    assert default_model_name(tmp_path / "ex.port") == "ex.port"
    assert default_model_name(tmp_path / "model.onnx") == "model"
    if UNAVAILABLE is not None:
        pytest.skip(reason=f"no Triton here: {UNAVAILABLE}")
    import sysconfig

    from hydra_deploy.serve.pytriton_app import prefer_own_libpython

    environ = {"LD_LIBRARY_PATH": "/opt/x:/usr/lib"}
    first = prefer_own_libpython(environ)
    if first is None:
        pytest.skip("this Python is not a shared build: the stub uses the system's libpython")
    assert first == sysconfig.get_config_var("LIBDIR")
    assert environ["LD_LIBRARY_PATH"].split(":") == [first, "/opt/x", "/usr/lib"]
    assert prefer_own_libpython(environ) == first  # idempotent
    assert environ["LD_LIBRARY_PATH"].count(first) == 1


# --- a text model, two instances, SIGTERM ------------------------------------------------------------
@needs_server
def test_text_export_with_two_instances_and_sigterm(tmp_path):
    from helpers.bert import tiny_bert

    backbone = tiny_bert("segments")
    spec = random_spec(backbone, members=3, heads_per_member=2, seed=2)
    out = tmp_path / "bert-m3"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), validate=False)
    runner = load_runner(out)
    assert runner.input_names == ("input_ids", "attention_mask", "token_type_ids")
    requests = []
    for index in range(12):  # lengths 5..9, padded rows: batched only with equal lengths
        x = backbone.example_inputs(1 + index % 3, seed=index, seq_len=5 + index % 5)
        requests.append({name: x[name].numpy() for name in runner.input_names})
    local = serve_load.expected_answers(runner, requests)
    process = serve_load.ServerProcess(
        out, tmp_path / "logs", extra_args=["--instances", "2", "--threads", "1"]
    )
    with process:
        assert process.info["instances"] == 2 and process.info["threads"] == 1
        assert [t["dims"] for t in process.info["inputs"]] == [[-1]] * 3
        for protocol, url in (("http", process.http_url), ("grpc", process.grpc_url)):
            run = serve_load.run_load(
                url, process.model_name, requests, threads=4, protocol=protocol
            )
            assert not run.errors, run.errors[0]
            for index, answer in enumerate(run.answers):
                diffs = serve_load.max_differences(answer, local[index])
                assert diffs["prediction"] == 0 and max(diffs.values()) <= ATOL, (index, diffs)
        children = serve_load.descendants(process.process.pid)
        code = process.stop(signal.SIGTERM, timeout_s=60)
    assert code == 0, process.log_tail()
    assert not serve_load.still_running(children, within_s=10), "left running"


# --- an export with decisions (hydra-calibrate) --------------------------------------------------------
DECISIONS = ("calibrated_probs", "confidence", "prediction_set", "accept", "ood_flag")


@pytest.fixture(scope="module")
def calibrated_dir(tmp_path_factory):
    from helpers.decisions import calibrated_export

    folder, _ = calibrated_export(tmp_path_factory.mktemp("calibrated") / "calibrated")
    return folder


def expected_decisions(folder, x) -> dict[str, np.ndarray]:
    from hydra_deploy.decisions import apply_decisions

    runner = load_runner(folder)
    return apply_decisions(runner(x)["member_logits"], runner.decisions)


def assert_decisions(served: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    batch = len(want["prediction"])
    np.testing.assert_array_equal(served["prediction"][:, 0], want["prediction"])
    assert served["calibrated_probs"].dtype == np.float32
    np.testing.assert_allclose(served["calibrated_probs"], want["calibrated_probs"], atol=ATOL)
    assert served["confidence"].shape == (batch, 1) and served["confidence"].dtype == np.float32
    np.testing.assert_allclose(served["confidence"][:, 0], want["confidence"], atol=ATOL)
    assert served["prediction_set"].shape == (batch, len(CLASSES))
    assert served["prediction_set"].dtype == np.bool_
    np.testing.assert_array_equal(served["prediction_set"], want["prediction_set"])
    for name in ("accept", "ood_flag"):
        assert served[name].shape == (batch, 1) and served[name].dtype == np.bool_, name
        np.testing.assert_array_equal(served[name][:, 0], want[name], err_msg=name)


def test_a_calibrated_export_answers_its_decisions_and_raw_leaves_them_out(calibrated_dir):
    pytest.importorskip(
        "pytriton", reason="PyTriton is not installed: pip install 'hydra-deploy[serve]'"
    )
    from pytriton.proxy.types import Request

    from hydra_deploy.serve.pytriton_app import HydraServer, ServeConfig, make_infer_func

    runner = load_runner(calibrated_dir)
    assert runner.decisions is not None
    x = images(4, 7)
    answers = make_infer_func(runner)(
        [Request(data={"pixel_values": x[:1]}), Request(data={"pixel_values": x[1:]})]
    )
    served = {k: np.concatenate([a[k] for a in answers]) for k in answers[0]}
    assert set(served) == {*OUTPUTS_RAW, *DECISIONS}
    assert_decisions(served, expected_decisions(calibrated_dir, x))
    raw = load_runner(calibrated_dir, decisions=False)
    for name in SCALAR_SCORES:  # the scores stay those of the raw probabilities
        np.testing.assert_allclose(
            served[name][:, 0], ensemble_scores(raw(x)["member_logits"])[name], atol=ATOL
        )

    ports = serve_load.free_ports(3)
    settings = dict(http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    server = HydraServer(ServeConfig(calibrated_dir, **settings))  # checked and loaded, not started
    try:
        info = server.describe()
    finally:
        server.close()
    outputs = {t["name"]: (t["dims"], t["dtype"]) for t in info["outputs"]}
    assert outputs["calibrated_probs"] == ([5], "float32")
    assert outputs["confidence"] == ([1], "float32")
    assert outputs["prediction_set"] == ([5], "bool")
    assert outputs["accept"] == outputs["ood_flag"] == ([1], "bool")
    record = runner.decisions
    assert info["decisions"]["temperature"] == record.temperature
    assert info["decisions"]["selective"]["target_risk"] == 0.2
    server = HydraServer(ServeConfig(calibrated_dir, decisions=False, **settings))
    try:
        raw_info = server.describe()
    finally:
        server.close()
    assert [t["name"] for t in raw_info["outputs"]] == list(OUTPUTS_RAW)
    assert raw_info["decisions"] is None


def test_stale_decisions_are_refused_unless_raw(calibrated_dir, tmp_path):
    pytest.importorskip(
        "pytriton", reason="PyTriton is not installed: pip install 'hydra-deploy[serve]'"
    )
    import json
    import shutil

    from hydra_deploy.serve.pytriton_app import HydraServer, ServeConfig

    stale = tmp_path / "stale"
    shutil.copytree(calibrated_dir, stale)
    record = json.loads((stale / "hydra.json").read_text())
    record["decisions"]["onnx_sha256"] = "0" * 64  # fitted on another model.onnx
    (stale / "hydra.json").write_text(json.dumps(record))
    ports = [str(p) for p in serve_load.free_ports(3)]
    code, out, err = invoke(
        str(stale), "--port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]
    )
    assert code == 1 and not out and err.count("\n") == 1, err
    assert "hydra-calibrate" in err and "--overwrite" in err
    server = HydraServer(
        ServeConfig(
            stale,
            decisions=False,
            **dict(zip(("http_port", "grpc_port", "metrics_port"), map(int, ports), strict=True)),
        )
    )
    try:
        assert "accept" not in [t["name"] for t in server.describe()["outputs"]]
    finally:
        server.close()


@needs_server
def test_served_decisions_over_http_and_grpc(calibrated_dir, tmp_path):
    import tritonclient.http as http

    process = serve_load.ServerProcess(calibrated_dir, tmp_path / "logs")
    with process:
        assert process.info["decisions"]["sets"] == {"method": "lac", "alpha": 0.1}
        c = http.InferenceServerClient(process.http_url)
        with contextlib.closing(c):
            config = c.get_model_config(process.model_name)
            metadata = c.get_model_metadata(process.model_name)
        types = {o["name"]: (o["data_type"], [int(d) for d in o["dims"]]) for o in config["output"]}
        assert types["prediction_set"] == ("TYPE_BOOL", [5])
        assert types["accept"] == types["ood_flag"] == ("TYPE_BOOL", [1])
        assert types["calibrated_probs"] == ("TYPE_FP32", [5])
        assert types["confidence"] == ("TYPE_FP32", [1])
        assert {o["name"]: o["datatype"] for o in metadata["outputs"]}["accept"] == "BOOL"
        for protocol, url in (("http", process.http_url), ("grpc", process.grpc_url)):
            module = serve_load.client_module(protocol)
            c = module.InferenceServerClient(url)
            with contextlib.closing(c):
                x = images(3, 8)
                tensor = module.InferInput("pixel_values", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                names = ("prediction", *DECISIONS)
                result = c.infer(
                    process.model_name,
                    [tensor],
                    outputs=[module.InferRequestedOutput(n) for n in names],
                )
                served = {n: result.as_numpy(n) for n in names}
            assert_decisions(served, expected_decisions(calibrated_dir, x))
        assert process.stop(signal.SIGINT, timeout_s=60) == 0, process.log_tail()


# --- last: the shared server stops on SIGINT -----------------------------------------------------------
@needs_server
def test_sigint_stops_the_server_cleanly(server):
    children = serve_load.descendants(server.process.pid)
    assert children, "the Triton server should run as a child process"
    started = time.monotonic()
    code = server.stop(signal.SIGINT, timeout_s=60)
    took = time.monotonic() - started
    assert code == 0, server.log_tail()
    assert took < 30, f"stopping took {took:.1f} s"
    assert not serve_load.still_running(children, within_s=10), "left running"
    stdout = (server.log_dir / "stdout.txt").read_text().splitlines()
    assert len(stdout) == 1 and stdout[0].startswith('{"model"'), stdout[:3]  # Triton's log: stderr
    from hydra_deploy.serve.pytriton_app import check_ports_free

    check_ports_free(
        "127.0.0.1",
        dict(zip(("--port", "--grpc-port", "--metrics-port"), server.ports, strict=True)),
    )
