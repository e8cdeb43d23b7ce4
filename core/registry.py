"""The plugin registry: which backends, drafters and acceptors exist, under which names, from where.

Built once per process from the built-in plugin modules and the `outrider` entry-point group.
`OUTRIDER_PLUGINS` (comma-separated entry-point or distribution names) limits which third-party
plugins load; set it to an empty string to load none. A third-party package that fails to import, or an
`OUTRIDER_PLUGINS` name that matches nothing installed, is a warning (`Registry.warnings`, printed once by
`default_registry`), not an error: the other plugins still work, and choosing a plugin the broken package
would have provided fails with the import error.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from outrider.config import parse_bool
from outrider.errors import ConfigError
from outrider.hookspecs import PLUGIN_KINDS, PROJECT, OutriderSpec

BUILTIN_PACKAGE = "outrider (built-in)"
BUILTIN_MODULES = (
    "outrider.plugins.backends.cpu",
    "outrider.plugins.backends.cuda",
    "outrider.plugins.drafters.none",
    "outrider.plugins.drafters.lookup",
    "outrider.plugins.drafters.draft_model",
    "outrider.plugins.drafters.gemma_assistant",
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


def as_the_instance_has_them(declared: dict[str, Any], instance: Any) -> dict[str, Any]:
    """The `declared` capabilities, each replaced by `instance`'s attribute of the same name where it has one
    (an option may switch a capability, so the instance wins)."""
    return {key: getattr(instance, key, value) for key, value in declared.items()}


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
                return parse_bool(value)
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


_NO_DEFAULT = object()


def signature_default(factory: Callable[..., Any], name: str) -> Any:
    """The default the factory's own signature gives keyword `name` (what a direct call would use)."""
    try:
        parameter = inspect.signature(factory).parameters.get(name)
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return _NO_DEFAULT
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return _NO_DEFAULT
    return parameter.default


def _as_option(name: str, value: Any, factory: Callable[..., Any]) -> Option:
    """An option is declared `(type, help)`; its default is the factory's own (declared once, in the
    signature, so a direct call and the registry agree)."""
    own = signature_default(factory, name)
    label = getattr(factory, "__qualname__", repr(factory))
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type) and isinstance(value[1], str)):
        raise TypeError(f"option {name!r} of {label}: give a (type, help) tuple (the default is the factory's), "
                        f"not {value!r}")
    if own is _NO_DEFAULT:
        raise TypeError(f"option {name!r}: {label} takes no keyword {name!r} with a default; give the parameter "
                        "a default in the signature (options take their default from there)")
    return Option(name, value[0], own, value[1])


class Registry:
    def __init__(self) -> None:
        self.plugins: dict[str, dict[str, PluginSpec]] = {kind: {} for kind in PLUGIN_KINDS}
        self._aliases: dict[str, dict[str, str]] = {kind: {} for kind in PLUGIN_KINDS}
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(OutriderSpec)
        self._packages: dict[str, str] = {}  # plugin name in pluggy -> distribution that provides it
        self.broken: dict[str, str] = {}  # entry-point name -> why its package could not be loaded
        self.warnings: list[str] = []

    def add_plugin(self, module: Any, name: str, package: str) -> None:
        self.manager.register(module, name=name)
        self._packages[name] = package

    def collect(self) -> None:
        for kind in PLUGIN_KINDS:
            hook = getattr(self.manager.hook, f"register_{kind}s")
            for impl in hook.get_hookimpls():
                package = self._packages.get(impl.plugin_name, impl.plugin_name)
                register = functools.partial(self._register, kind, package)
                if package == BUILTIN_PACKAGE or not impl.plugin_name.startswith("entrypoint:"):
                    impl.function(register=register)
                    continue
                try:
                    impl.function(register=register)
                except ConfigError:
                    raise  # two packages claiming one name: the user must choose
                except Exception as exc:  # like a failed import: warn, and keep the other plugins
                    name = impl.plugin_name.removeprefix("entrypoint:")
                    problem = (f"plugin '{name}' from {package} failed in register_{kind}s ({type(exc).__name__}: "
                               f"{exc}); fix or uninstall it, or leave it out with OUTRIDER_PLUGINS")
                    self.broken[name] = problem
                    self.warnings.append(problem)

    def _register(self, kind: str, package: str, name: str, factory: Callable[..., Any], *,
                  aliases: tuple[str, ...] | list[str] = (), options: dict[str, Any] | None = None,
                  capabilities: dict[str, Any] | None = None) -> None:
        caps = {key: getattr(factory, key, default) for key, default in CAPABILITY_DEFAULTS[kind].items()}
        caps.update(capabilities or {})
        declared = {key: _as_option(key, value, factory) for key, value in (options or {}).items()}
        spec = PluginSpec(kind, name, factory, tuple(aliases), declared, caps, package)
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
            if name in self.broken:
                raise ConfigError(self.broken[name])
            valid = ", ".join(sorted(self.plugins[kind]))
            note = f"; {'; '.join(self.broken.values())}" if self.broken else ""
            raise ConfigError(f"unknown {kind} '{name}'; installed {kind}s: {valid} (see `outrider plugins`){note}")
        return spec

    def all(self) -> list[PluginSpec]:
        return [spec for kind in PLUGIN_KINDS for spec in self.plugins[kind].values()]


def _selected_entry_points(registry: Registry):
    wanted = os.environ.get("OUTRIDER_PLUGINS")
    names = None if wanted is None else {part.strip() for part in wanted.split(",") if part.strip()}
    installed = [(ep, ep.dist.name if ep.dist else "") for ep in entry_points(group=PROJECT)]
    if names:
        known = {ep.name for ep, _ in installed} | {dist for _, dist in installed}
        for name in sorted(names - known):
            have = ", ".join(sorted(f"{ep.name} ({dist})" if dist else ep.name for ep, dist in installed)) or "none"
            registry.warnings.append(f"OUTRIDER_PLUGINS names '{name}', which no installed plugin has; installed "
                                     f"third-party plugins: {have}")
    for ep, dist in installed:
        if names is None or ep.name in names or dist in names:
            yield ep, dist


def build_registry(third_party: bool = True) -> Registry:
    registry = Registry()
    for module_name in BUILTIN_MODULES:
        registry.add_plugin(import_module(module_name), module_name, BUILTIN_PACKAGE)
    if third_party:
        for ep, dist in _selected_entry_points(registry):
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party package must not take the CLI down
                problem = (f"plugin '{ep.name}' from {dist or ep.value} failed to import ({type(exc).__name__}: "
                           f"{exc}); fix or uninstall it, or leave it out with OUTRIDER_PLUGINS")
                registry.broken[ep.name] = problem
                registry.warnings.append(problem)
                continue
            version = ep.dist.version if ep.dist else ""
            registry.add_plugin(plugin, f"entrypoint:{ep.name}", f"{dist} {version}".strip())
    registry.collect()
    return registry


@functools.cache
def default_registry() -> Registry:
    """The process's registry, built on first use; its warnings are printed then, once, to stderr."""
    registry = build_registry()
    for warning in registry.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return registry
