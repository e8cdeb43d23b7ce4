"""The plugin registry: which backends, drafters and acceptors exist, under which names, from where.

Built once per process from the built-in plugin modules and the `outrider` entry-point group.
`OUTRIDER_PLUGINS` (comma-separated entry-point or distribution names) limits which third-party
plugins load; set it to an empty string to load none.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from .errors import ConfigError
from .hookspecs import PROJECT, OutriderSpec

KINDS = ("backend", "drafter", "acceptor")
BUILTIN_PACKAGE = "outrider (built-in)"
BUILTIN_MODULES = (
    "outrider.plugins.backends.cpu",
    "outrider.plugins.backends.cuda",
    "outrider.plugins.drafters.none",
    "outrider.plugins.drafters.lookup",
    "outrider.plugins.drafters.draft_model",
    "outrider.plugins.drafters.mtp",
    "outrider.plugins.acceptors.greedy",
    "outrider.plugins.acceptors.sampled",
    "outrider.plugins.acceptors.pmin",
)
# Capabilities read from a factory's attributes when `register` is not given them explicitly.
CAPABILITY_DEFAULTS = {
    "backend": {},
    "drafter": {"gives_draft_probs": False, "needs": frozenset()},
    # greedy_only: lossless at temperature 0 only (it ignores the temperature)
    "acceptor": {"lossless": True, "needs_draft_probs": False, "greedy_only": False},
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str = ""

    def parse(self, value: Any, owner: str) -> Any:
        if isinstance(value, self.type) and not (self.type is int and isinstance(value, bool)):
            return value
        try:
            if self.type is bool:
                text = str(value).strip().lower()
                if text not in _TRUE | _FALSE:
                    raise ValueError
                return text in _TRUE
            if self.type is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return self.type(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option '{self.name}' of {owner} takes a {self.type.__name__}, got {value!r}") from None


@dataclass(frozen=True)
class PluginSpec:
    kind: str
    name: str
    factory: Callable[..., Any]
    aliases: tuple[str, ...] = ()
    options: dict[str, Option] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)
    package: str = BUILTIN_PACKAGE

    @property
    def label(self) -> str:
        return f"{self.kind} '{self.name}'"

    def resolve_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Validated, converted option values: defaults overlaid with `settings`."""
        unknown = sorted(set(settings) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "(it takes none)"
            raise ConfigError(f"unknown option '{unknown[0]}' for {self.label}; valid options: {valid}")
        values = {name: option.default for name, option in self.options.items()}
        values.update({name: self.options[name].parse(value, self.label) for name, value in settings.items()})
        return values

    def create(self, settings: dict[str, Any] | None = None) -> Any:
        return self.factory(**self.resolve_options(settings or {}))


def _as_option(name: str, value: Any) -> Option:
    if isinstance(value, Option):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3):
        return Option(name, *value)
    raise TypeError(f"option {name!r}: give an Option or a (type, default, help) tuple, not {value!r}")


class Registry:
    def __init__(self) -> None:
        self.plugins: dict[str, dict[str, PluginSpec]] = {kind: {} for kind in KINDS}
        self._aliases: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(OutriderSpec)
        self._packages: dict[str, str] = {}  # plugin name in pluggy -> distribution that provides it

    def add_plugin(self, module: Any, name: str, package: str) -> None:
        self.manager.register(module, name=name)
        self._packages[name] = package

    def collect(self) -> None:
        for kind in KINDS:
            hook = getattr(self.manager.hook, f"register_{kind}s")
            for impl in hook.get_hookimpls():
                package = self._packages.get(impl.plugin_name, impl.plugin_name)
                impl.function(register=functools.partial(self._register, kind, package))

    def _register(self, kind: str, package: str, name: str, factory: Callable[..., Any], *,
                  aliases: tuple[str, ...] | list[str] = (), options: dict[str, Any] | None = None,
                  capabilities: dict[str, Any] | None = None) -> None:
        caps = {key: getattr(factory, key, default) for key, default in CAPABILITY_DEFAULTS[kind].items()}
        caps.update(capabilities or {})
        spec = PluginSpec(kind, name, factory, tuple(aliases),
                          {key: _as_option(key, value) for key, value in (options or {}).items()}, caps, package)
        for claimed in (name, *spec.aliases):
            owner = self._owner(kind, claimed)
            if owner is not None:
                raise ConfigError(f"{kind} name '{claimed}' is claimed twice: by {owner.package} ({owner.name}) and by "
                                  f"{package} ({name}); uninstall one or limit OUTRIDER_PLUGINS")
        self.plugins[kind][name] = spec
        for alias in spec.aliases:
            self._aliases[kind][alias] = name

    def _owner(self, kind: str, name: str) -> PluginSpec | None:
        canonical = self._aliases[kind].get(name, name)
        return self.plugins[kind].get(canonical)

    def get(self, kind: str, name: str) -> PluginSpec:
        spec = self._owner(kind, name)
        if spec is None:
            valid = ", ".join(sorted(self.plugins[kind]))
            raise ConfigError(f"unknown {kind} '{name}'; installed {kind}s: {valid} (see `outrider plugins`)")
        return spec

    def all(self) -> list[PluginSpec]:
        return [spec for kind in KINDS for spec in self.plugins[kind].values()]


def _selected_entry_points():
    wanted = os.environ.get("OUTRIDER_PLUGINS")
    names = None if wanted is None else {part.strip() for part in wanted.split(",") if part.strip()}
    for ep in entry_points(group=PROJECT):
        dist = ep.dist.name if ep.dist else ""
        if names is None or ep.name in names or dist in names:
            yield ep, dist


def build_registry(third_party: bool = True) -> Registry:
    registry = Registry()
    for module_name in BUILTIN_MODULES:
        registry.add_plugin(import_module(module_name), module_name, BUILTIN_PACKAGE)
    if third_party:
        for ep, dist in _selected_entry_points():
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party package must not take the CLI down
                raise ConfigError(f"plugin '{ep.name}' from {dist or ep.value} failed to import ({exc}); "
                                  f"fix or uninstall it, or leave it out with OUTRIDER_PLUGINS") from None
            version = ep.dist.version if ep.dist else ""
            registry.add_plugin(plugin, f"entrypoint:{ep.name}", f"{dist} {version}".strip())
    registry.collect()
    return registry


@functools.cache
def default_registry() -> Registry:
    return build_registry()
