"""Third-party packages as the registry meets them: a package whose import raises is one warning and the
CLI goes on (failing only when that plugin is chosen), and an OUTRIDER_PLUGINS name that matches nothing
installed is a warning listing what is installed. The packages are real distributions (a .dist-info folder
with an `outrider` entry point) put on sys.path, found by importlib.metadata as pip-installed ones are."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from outrider import registry as registry_module
from outrider.cli import main
from outrider.testing.fixtures import plain_greedy


def _distribution(folder, dist: str, entry: str, module: str, source: str) -> None:
    info = folder / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[outrider]\n{entry} = {module}\n")
    (folder / f"{module}.py").write_text(source)


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    _distribution(tmp_path, "outrider-bigram", "bigram", "outrider_bigram_broken",
                  "raise ImportError('cannot import name Drafter from outrider.drafts')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("OUTRIDER_PLUGINS", raising=False)
    registry_module.default_registry.cache_clear()
    yield
    registry_module.default_registry.cache_clear()


def test_a_package_that_fails_to_import_is_one_warning_and_generate_goes_on(broken_package, outrider_contract_fixtures):
    path = outrider_contract_fixtures.tiny_llama_path
    result = CliRunner().invoke(main, ["generate", "-m", str(path), "--drafter", "lookup", "-n", "8", "--json",
                                       "one two one two one two"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stderr
    assert "plugin 'bigram' from outrider-bigram failed to import (ImportError: cannot import name Drafter" in warnings[0]
    out = json.loads(result.stdout)
    model = outrider_contract_fixtures.target("llama").model
    assert out["tokens"] == plain_greedy(model, out["prompt_tokens"], len(out["tokens"]))


def test_choosing_the_broken_plugin_fails_with_its_import_error(broken_package, outrider_contract_fixtures):
    path = outrider_contract_fixtures.tiny_llama_path
    result = CliRunner().invoke(main, ["generate", "-m", str(path), "--drafter", "bigram", "hello"])
    assert result.exit_code == 1
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: plugin 'bigram' from outrider-bigram failed to import"), result.stderr
    check = CliRunner().invoke(main, ["check", "bigram"])
    assert check.exit_code == 1 and "failed to import" in check.stderr.strip().splitlines()[-1], check.stderr


def test_outrider_plugins_listing_goes_on(broken_package):
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    assert {"lookup", "sampled", "cpu"} <= {row["name"] for row in json.loads(result.stdout)}


def test_an_outrider_plugins_typo_warns_with_the_installed_names(tmp_path, monkeypatch):
    _distribution(tmp_path, "outrider-repeat", "repeat", "outrider_repeat_ok", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OUTRIDER_PLUGINS", "reepat")
    registry = registry_module.build_registry()
    assert len(registry.warnings) == 1, registry.warnings
    assert "OUTRIDER_PLUGINS names 'reepat', which no installed plugin has" in registry.warnings[0]
    assert "repeat (outrider-repeat)" in registry.warnings[0]
    monkeypatch.setenv("OUTRIDER_PLUGINS", "outrider-repeat")  # a distribution name is no typo
    assert registry_module.build_registry().warnings == []
