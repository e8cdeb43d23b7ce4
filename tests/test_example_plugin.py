"""The example third-party package (examples/outrider-suffix), as a user meets it once it is installed:
listed by `outrider plugins`, passing `outrider check`, and decoding with `--drafter suffix`.
`./scripts/setup --test` installs it; without it these tests skip."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from outrider.cli import main
from outrider.testing.fixtures import plain_greedy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("outrider_suffix") is None,
                                reason="the example plugin is not installed: pip install -e examples/outrider-suffix")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_listed_by_outrider_plugins_with_its_package():
    result = invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    rows = {(row["kind"], row["name"]): row for row in json.loads(result.output)}
    row = rows[("drafter", "suffix")]
    assert row["package"].startswith("outrider-suffix ")
    assert set(row["options"]) == {"max_depth", "min_match", "max_history_tokens"}


def test_passes_outrider_check():
    result = invoke("check", "suffix")
    assert result.exit_code == 0, result.output
    assert "drafter 'suffix' from outrider-suffix" in result.output and "0 failed" in result.output


def test_generate_with_the_suffix_drafter_equals_plain_greedy(outrider_contract_fixtures):
    path = outrider_contract_fixtures.tiny_llama_path
    prompt = "the cat the cat the cat the"
    result = invoke("generate", "-m", path, "--drafter", "suffix", "-o", "drafter.min_match", "1", "-n", 24,
                    "--draft-max", 4, "--json", prompt)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["stats"]["plugins"]["drafter"] == "suffix"
    assert out["stats"]["drafted"] > 0
    model = outrider_contract_fixtures.target("llama").model
    assert out["tokens"] == plain_greedy(model, out["prompt_tokens"], len(out["tokens"]))
