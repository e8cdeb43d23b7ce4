"""Settings precedence, plugin lookup and options, capability checks."""

from __future__ import annotations

import types

import pytest

from outrider.assembly import check_pair
from outrider.config import resolve_config
from outrider.errors import ConfigError
from outrider.hookspecs import hookimpl
from outrider.registry import BUILTIN_PACKAGE, Registry, build_registry
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.sampling import SamplingParams


@pytest.fixture(scope="module")
def registry():
    return build_registry(third_party=False)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    config_file = tmp_path / "o.toml"
    config_file.write_text('drafter = "none"\ndraft_max = 3\ntemperature = 0.5\n[options.drafter]\nmax_n = 6\n')
    env = {"OUTRIDER_DRAFT_MAX": "5", "OUTRIDER_TEMPERATURE": "0.25", "OUTRIDER_HOME": "/elsewhere"}
    config = resolve_config({"temperature": 0.9, "seed": None}, config_file, env)
    assert (config["drafter"], config.sources["drafter"]) == ("none", "file o.toml")
    assert (config["draft_max"], config.sources["draft_max"]) == (5, "env OUTRIDER_DRAFT_MAX")
    assert (config["temperature"], config.sources["temperature"]) == (0.9, "flag")
    assert (config["max_tokens"], config.sources["max_tokens"]) == (128, "default")
    assert config.options["drafter"] == {"max_n": 6}
    report = config.report()
    assert report["settings"]["draft_max"] == {"value": 5, "source": "env OUTRIDER_DRAFT_MAX"}


def test_unknown_config_key_lists_the_valid_ones(tmp_path):
    config_file = tmp_path / "bad.toml"
    config_file.write_text("draft_maximum = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'draft_maximum'.*valid keys: model, backend"):
        resolve_config({}, config_file, {})


def test_bad_values_name_the_setting_and_source(tmp_path):
    with pytest.raises(ConfigError, match="draft_max from env OUTRIDER_DRAFT_MAX must be a number >= 0 or auto"):
        resolve_config({}, None, {"OUTRIDER_DRAFT_MAX": "many"})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config({}, tmp_path / "absent.toml", {})
    config_file = tmp_path / "zero.toml"
    config_file.write_text("max_tokens = 0\n")
    for flags, file, env, source in [({"max_tokens": -5}, None, {}, "flag"),
                                     ({}, None, {"OUTRIDER_MAX_TOKENS": "-1"}, "env OUTRIDER_MAX_TOKENS"),
                                     ({}, config_file, {}, "file zero.toml")]:
        with pytest.raises(ConfigError, match=f"max_tokens from {source} must be at least 1"):
            resolve_config(flags, file, env)
    assert resolve_config({"max_tokens": 1}, None, {})["max_tokens"] == 1


def test_every_builtin_is_registered_with_its_capabilities(registry):
    names = {(spec.kind, spec.name) for spec in registry.all()}
    assert {("backend", "cpu"), ("backend", "cuda"), ("drafter", "none"), ("drafter", "lookup"),
            ("drafter", "draft-model"), ("acceptor", "greedy"), ("acceptor", "sampled"),
            ("acceptor", "p-min")} <= names
    assert all(spec.package == BUILTIN_PACKAGE for spec in registry.all())
    assert registry.get("acceptor", "p-min").capabilities["lossless"] is False
    assert registry.get("acceptor", "sampled").capabilities["lossless"] is True
    assert registry.get("drafter", "draft-model").capabilities["needs"] == frozenset({"draft_model"})
    assert registry.get("drafter", "ngram").name == "lookup"  # alias


def test_unknown_plugin_and_option_list_the_valid_ones(registry):
    with pytest.raises(ConfigError, match=r"unknown drafter 'eagle'; installed drafters: draft-model, gemma-assistant, lookup, mtp, none"):
        registry.get("drafter", "eagle")
    with pytest.raises(ConfigError, match=r"unknown option 'n' for drafter 'lookup'; valid options: max_n, min_n"):
        registry.get("drafter", "lookup").create({"n": 3})
    with pytest.raises(ConfigError, match="takes a int"):
        registry.get("drafter", "lookup").create({"max_n": "lots"})
    assert registry.get("drafter", "lookup").create({"max_n": "6"}).max_n == 6


def test_two_plugins_claiming_one_name_are_both_named():
    class Drafter:
        pass

    def plugin(name):
        module = types.SimpleNamespace()

        @hookimpl
        def register_drafters(register):
            register("lookup", Drafter)

        module.register_drafters = register_drafters
        return module

    registry = Registry()
    registry.add_plugin(plugin("a"), "first", "pkg-one 1.0")
    registry.add_plugin(plugin("b"), "second", "pkg-two 2.0")
    with pytest.raises(ConfigError, match=r"claimed twice: by pkg-.* \(lookup\) and by pkg-.* \(lookup\)"):
        registry.collect()


def test_impossible_pair_is_refused_and_lossy_acceptor_warns(registry):
    class NeedsQ:
        lossless = True
        needs_draft_probs = True

    lookup = registry.get("drafter", "lookup")
    traits = DrafterTraits.of(lookup.create(), lookup.capabilities)
    fake = registry.get("acceptor", "sampled").__class__(
        "acceptor", "needs-q", NeedsQ, capabilities={"lossless": True, "needs_draft_probs": True})
    with pytest.raises(ConfigError, match="needs draft probabilities, but drafter 'lookup' drafts deterministically"):
        check_pair(lookup, fake, traits, SamplingParams())
    warnings = check_pair(lookup, registry.get("acceptor", "p-min"), traits, SamplingParams())
    assert any("lossy" in w for w in warnings)
    assert check_pair(lookup, registry.get("acceptor", "sampled"), traits, SamplingParams(0.7)) == []


def test_an_acceptor_lossless_at_temperature_0_only_warns_above_it_whatever_its_name(registry):
    lookup = registry.get("drafter", "lookup")
    traits = DrafterTraits.of(lookup.create(), lookup.capabilities)
    spec = registry.get("acceptor", "greedy")
    argmax_only = type(spec)("acceptor", "argmax-only", spec.factory, capabilities={"greedy_only": True})
    for acceptor in (spec, argmax_only):
        warned = check_pair(lookup, acceptor, traits, SamplingParams(0.7))
        assert any("ignores temperature 0.7" in w for w in warned), (acceptor.name, warned)
        assert check_pair(lookup, acceptor, traits, SamplingParams(0.0)) == []
    sampled = registry.get("acceptor", "sampled")
    assert check_pair(lookup, sampled, traits, SamplingParams(0.7)) == []


def test_llama_cpp_sampling_settings_reach_the_sampling_params(tmp_path):
    from outrider.assembly import sampling_params

    config_file = tmp_path / "s.toml"
    config_file.write_text("min_p = 0.05\nrepeat_penalty = 1.1\nrepeat_last_n = -1\n")
    config = resolve_config({"presence_penalty": 0.5}, config_file, {"OUTRIDER_FREQUENCY_PENALTY": "0.25"})
    assert sampling_params(config) == SamplingParams(min_p=0.05, repeat_penalty=1.1, presence_penalty=0.5,
                                                     frequency_penalty=0.25, repeat_last_n=-1)
    with pytest.raises(ConfigError, match="unknown key 'min_pp'"):
        config_file.write_text("min_pp = 0.05\n")
        resolve_config({}, config_file, {})
