"""What `outrider plugins` and `generate --json` say about plugins is what the configured instances do:
capabilities read from the instance, every plugin option with its value and source, `auto` listed as the
default acceptor; option defaults declared once (the factory's signature), and one boolean parser."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from outrider.cli import main
from outrider.config import parse_bool, resolve_config
from outrider.hookspecs import hookimpl
from outrider.registry import Option, Registry


def _plugins_json():
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    return {(row["kind"], row["name"]): row for row in json.loads(result.stdout)}


def test_plugins_lists_auto_as_the_default_acceptor_and_the_defaults_of_each_kind():
    rows = _plugins_json()
    assert rows[("acceptor", "auto")]["default"] is True
    assert "greedy at temperature 0, sampled above" in rows[("acceptor", "auto")]["chooses"]
    assert [name for (kind, name), row in rows.items() if row["default"]] == ["cpu", "lookup", "auto"]


def test_plugins_shows_capabilities_as_an_instance_with_the_default_options_has_them():
    # draft-model gives q only with -o drafter.sample true
    assert _plugins_json()[("drafter", "draft-model")]["capabilities"]["gives_draft_probs"] is False


def test_generate_json_reports_every_option_with_its_source_and_the_instances_capabilities(outrider_contract_fixtures):
    fx = outrider_contract_fixtures
    result = CliRunner().invoke(main, [
        "generate", "-m", str(fx.tiny_llama_path), "--drafter", "draft-model", "--draft-model",
        str(fx.tiny_draft_llama_path), "-o", "drafter.sample", "true", "--temp", "0.8", "--seed", "1", "-n", "4",
        "--json", "hello"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    drafter = stats["config"]["options"]["drafter"]
    assert drafter["sample"] == {"value": True, "source": "flag -o"}
    assert drafter["context"] == {"value": 4096, "source": "default"}
    assert drafter["model"]["source"] == "flag"  # from --draft-model
    assert stats["config"]["options"]["backend"]["weights"] == {"value": "compact", "source": "default"}
    assert stats["capabilities"]["drafter"]["gives_draft_probs"] is True
    assert stats["capabilities"]["acceptor"]["lossless"] is True


class Counting:
    def __init__(self, depth: int = 4, strict: bool = False):
        self.depth, self.strict = depth, strict


def _register(options):
    registry = Registry()
    module = type("M", (), {"register_drafters": staticmethod(hookimpl(
        lambda register: register("counting", Counting, options=options)))})
    registry.add_plugin(module, "m", "test")
    registry.collect()
    return registry.get("drafter", "counting")


def test_an_option_given_as_type_and_help_takes_the_signatures_default():
    spec = _register({"depth": (int, "how deep"), "strict": (bool, "be strict")})
    assert (spec.options["depth"].default, spec.options["depth"].help) == (4, "how deep")
    assert spec.options["strict"].default is False


@pytest.mark.parametrize("option", [(int, 4, "how deep"), (int, 4), Option("depth", int, 4, "how deep"), "how deep"])
def test_an_option_in_any_other_shape_is_refused(option):
    with pytest.raises(TypeError, match=r"option 'depth' of Counting: give a \(type, help\) tuple"):
        _register({"depth": option})


def test_an_option_without_a_default_in_the_signature_is_refused():
    with pytest.raises(TypeError, match="give the parameter a default in the signature"):
        _register({"colour": (str, "which colour")})


def test_every_built_in_plugin_declares_its_options_in_the_one_shape():
    from outrider.registry import build_registry

    registry = build_registry(third_party=False)  # another shape raises TypeError
    assert registry.get("backend", "cpu").options["weights"].default == "compact"


@pytest.mark.parametrize("text,value", [("1", True), ("Yes", True), (" on ", True), ("0", False), ("off", False),
                                        ("", False)])
def test_one_boolean_parser_for_settings_and_options(text, value):
    assert parse_bool(text) is value
    assert Option("strict", bool, False).parse(text, "drafter 'x'") is value
    assert resolve_config({}, None, {"OUTRIDER_CHAT": text})["chat"] is value


def test_a_word_that_is_not_a_boolean_is_refused_by_both():
    from outrider.errors import ConfigError

    with pytest.raises(ConfigError, match="option 'strict' of drafter 'x' takes a bool, got 'maybe'"):
        Option("strict", bool, False).parse("maybe", "drafter 'x'")
    with pytest.raises(ConfigError, match="chat from env OUTRIDER_CHAT must be a bool"):
        resolve_config({}, None, {"OUTRIDER_CHAT": "maybe"})


def test_outrider_check_builds_the_kernels_before_the_first_check_and_says_so(monkeypatch):
    import time

    import outrider.native
    import outrider.testing.report as report

    events = []

    def slow_build():  # stands in for a first build; the real one is cached per machine and shared
        events.append("build")
        time.sleep(1.05)

    def run_contract(subject):
        events.append("check")
        return []

    monkeypatch.setattr(outrider.native, "load", slow_build)
    monkeypatch.setattr(report, "run_contract", run_contract)
    result = CliRunner().invoke(main, ["check", "lookup"])
    assert result.exit_code == 0, result.output
    assert events == ["build", "check"]
    assert "CPU kernels ready after 1s; the checks' times below do not include the build" in result.stderr
