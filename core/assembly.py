"""Assembling a runner from a resolved config: plugins looked up by name, options validated, the
drafter's traits settled once (`DrafterTraits`) and checked against the acceptor. This is the only place
pluggy-registered plugins are resolved; the runner works with the plain objects it gets from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outrider.catalog import resolve_model
from outrider.config import PLUGIN_KINDS, Config
from outrider.errors import ConfigError
from outrider.io.gguf import GGUFFile
from outrider.io.tokenizer import Tokenizer
from outrider.registry import PluginSpec, Registry, default_registry
from outrider.spec.chain import chain_names, chain_spec, is_chain
from outrider.spec.drafter import (
    NEEDS_DRAFT_MODEL,
    NEEDS_MTP_HEAD,
    NEEDS_TARGET_HIDDEN,
    NEEDS_TARGET_KV,
    DraftControls,
    Target,
)
from outrider.spec.drafter_traits import DrafterTraits
from outrider.spec.runner import Runner
from outrider.spec.sampling import SamplingParams

SUPPORTED_NEEDS = {NEEDS_DRAFT_MODEL, NEEDS_TARGET_HIDDEN, NEEDS_TARGET_KV, NEEDS_MTP_HEAD}


@dataclass
class Assembly:
    runner: Runner
    tokenizer: Tokenizer
    gguf: GGUFFile
    params: SamplingParams
    plugins: dict[str, PluginSpec]
    options: dict[str, dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


def choose_acceptor(name: str, params: SamplingParams) -> str:
    if name == "auto":
        return "greedy" if params.greedy else "sampled"
    return name


SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "seed", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "repeat_last_n")


def sampling_params(config: Config) -> SamplingParams:
    return SamplingParams(**{name: config[name] for name in SAMPLING_SETTINGS})


def _plugin_options(config: Config, specs: dict[str, PluginSpec]) -> dict[str, dict[str, Any]]:
    options = {kind: dict(config.options[kind]) for kind in PLUGIN_KINDS}
    for name, (value, _) in config.loose_options.items():
        owners = [kind for kind in PLUGIN_KINDS if name in specs[kind].options]
        if len(owners) != 1:
            where = " and ".join(specs[k].label for k in owners) if owners else "none of the chosen plugins"
            valid = ", ".join(f"{kind}.{opt}" for kind in PLUGIN_KINDS for opt in specs[kind].options)
            raise ConfigError(f"-o {name}: declared by {where}; write it as KIND.{name}. Valid options: {valid or 'none'}")
        options[owners[0]][name] = value
        config.option_sources[owners[0]][name] = "flag -o"
    if config["draft_model"] and "model" in specs["drafter"].options:
        options["drafter"].setdefault("model", config["draft_model"])
        config.option_sources["drafter"].setdefault("model", config.sources["draft_model"])
    return options


def drafter_spec(registry: Registry, name: str) -> PluginSpec:
    """The drafter `name`, or the combination `a,b` (also `a+b`) of drafters, the first with a draft drafting."""
    if not is_chain(name):
        return registry.get("drafter", name)
    names = chain_names(name)
    if len(names) < 2:
        raise ConfigError(f"drafter '{name}': a combination needs two or more drafters, e.g. lookup,mtp")
    return chain_spec([registry.get("drafter", n) for n in names])


def check_pair(drafter: PluginSpec, acceptor: PluginSpec, traits: DrafterTraits, params: SamplingParams) -> list[str]:
    """Refuse a drafter/acceptor pair that cannot work; return warnings for ones that work but lose something.
    `traits` are the drafter instance's (`DrafterTraits.of`)."""
    missing = traits.needs - SUPPORTED_NEEDS
    if missing:
        raise ConfigError(f"{drafter.label} needs {', '.join(sorted(missing))}, which this version of Outrider cannot give")
    if traits.reads_the_target and not traits.observes:
        raise ConfigError(f"{drafter.label} needs the target's hidden states or KV cache but has no "
                          "observe(hidden, start, cache) method to receive them; add one (see docs/plugins.md)")
    if acceptor.capabilities.get("needs_draft_probs") and not traits.gives_draft_probs:
        raise ConfigError(f"{acceptor.label} needs draft probabilities, but {drafter.label} drafts deterministically "
                          "and gives none; choose the sampled or greedy acceptor, or a drafter that samples")
    warnings = []
    if not acceptor.capabilities.get("lossless", True):
        warnings.append(f"{acceptor.label} is lossy: the output may differ from what the target alone would produce")
    if acceptor.capabilities.get("greedy_only") and not params.greedy:
        warnings.append(f"{acceptor.label} ignores temperature {params.temperature}: the output is the target's greedy "
                        "decoding; use --acceptor sampled (or auto) to sample")
    return warnings


def assemble(config: Config, registry: Registry | None = None) -> Assembly:
    registry = registry or default_registry()
    params = sampling_params(config)
    names = {"backend": config["backend"], "drafter": config["drafter"],
             "acceptor": choose_acceptor(config["acceptor"], params)}
    specs = {kind: registry.get(kind, name) for kind, name in names.items() if kind != "drafter"}
    specs["drafter"] = drafter_spec(registry, names["drafter"])
    options = _plugin_options(config, specs)
    resolved = {kind: specs[kind].resolve_options(options[kind]) for kind in PLUGIN_KINDS}

    backend = specs["backend"].factory(**resolved["backend"])
    drafter = specs["drafter"].factory(**resolved["drafter"])
    acceptor = specs["acceptor"].factory(**resolved["acceptor"])
    traits = DrafterTraits.of(drafter, specs["drafter"].capabilities, config["draft_max"])
    warnings = check_pair(specs["drafter"], specs["acceptor"], traits, params)

    gguf = GGUFFile(resolve_model(config["model"]))
    model = backend.load_model(gguf)  # first: an unknown architecture is the more useful error
    tokenizer = Tokenizer.from_gguf(gguf)
    target = Target(model=model, tokenizer=tokenizer, gguf=gguf, backend=backend)
    drafter.setup(target)
    controls = DraftControls(draft_min=config["draft_min"], draft_p_min=config["draft_p_min"])
    runner = Runner(target, drafter, acceptor, traits, controls=controls, context=config["context"])
    return Assembly(runner, tokenizer, gguf, params, specs, resolved, warnings)
