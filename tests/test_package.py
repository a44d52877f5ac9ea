"""Package-level promises: a cheap import (no torch for the edge runtime) and the public names."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


def test_top_level_specs_and_uncertainty_import_without_torch():
    modules = _imported_after(
        "import hydra_deploy, hydra_deploy.specs, hydra_deploy.uncertainty.metrics; "
        "hydra_deploy.HydraSpec; hydra_deploy.uncertainty.ensemble_scores"
    )
    assert {"hydra_deploy.specs", "hydra_deploy.uncertainty.scores"} <= modules
    assert not {"torch", "timm", "transformers"} & modules


def test_public_names_resolve_lazily():
    import hydra_deploy

    for name in hydra_deploy.__all__:
        assert getattr(hydra_deploy, name) is not None, name
    assert set(hydra_deploy.__all__) <= set(dir(hydra_deploy))
    with pytest.raises(AttributeError, match="no_such_name"):
        hydra_deploy.no_such_name  # noqa: B018


def _console_scripts() -> dict[str, str]:
    """The installed package's console scripts (pyproject's [project.scripts])."""
    from importlib.metadata import distribution

    points = distribution("hydra-deploy").entry_points
    return {p.name: p.value for p in points if p.group == "console_scripts"}


@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_every_command_has_help_with_examples(script, capsys):
    """Each console script resolves to a main() whose --help exits 0 and shows examples."""
    import importlib

    module, _, function = _console_scripts()[script].partition(":")
    main = getattr(importlib.import_module(module), function)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {script}") and "examples:" in text and "--debug" in text
    examples = text.partition("examples:")[2].strip("\n").splitlines()
    # every example pastes into a shell: a command per line, continued with one trailing backslash
    continued = False
    for line in examples:
        if not line.strip():
            continue
        assert line.strip() != "\\" and not line.rstrip().endswith("\\\\"), (script, line)
        assert continued or line.split()[0] in (script, "python"), (script, line)
        continued = line.rstrip().endswith("\\")
    assert not continued, (script, "the last example ends with a backslash")


def test_serving_runtime_imports_without_torch():
    """The Triton repository writer, hydra-serve and the Ray scorer are runtime code: numpy and
    the serving library, never torch."""
    modules = _imported_after(
        "import hydra_deploy.serve.triton_repo, hydra_deploy.serve.pytriton_app, "
        "hydra_deploy.distributed.ray_score, hydra_deploy.cli.serve, hydra_deploy.cli.score_dataset"
    )
    assert "hydra_deploy.serve.triton_repo" in modules
    assert not {"torch", "timm", "transformers"} & modules
