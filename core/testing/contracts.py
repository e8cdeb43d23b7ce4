"""Contract test classes a plugin package subclasses, and the registry-wide run over every installed plugin.

    from outrider.testing.contracts import DrafterContract

    class TestSuffixDrafter(DrafterContract):
        plugin_name = "suffix"                 # looked up in the registry, created with plugin_options
        plugin_options = {"max_depth": 16}

    # or, to test an object that is not registered (or needs special construction):
    class TestMyAcceptor(AcceptorContract):
        def make_acceptor(self):
            return MyAcceptor(strict=True)

Each check of `outrider.testing.checks` becomes one test method; a check that the plugin's capabilities make
meaningless is skipped with the reason. The fixtures (tiny GGUF models written on the fly) come from the
`outrider_contract_fixtures` fixture of the pytest plugin that installing outrider registers (`pytest11`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from outrider import registry as registry_module
from outrider.registry import Registry
from outrider.testing.checks import CHECKS, Check, CheckSkipped, Subject
from outrider.testing.fixtures import ContractFixtures


def _run(check: Check, subject: Subject) -> None:
    __tracebackhide__ = True  # the failure message is the report; the harness frames are noise
    try:
        check.run(subject)
    except CheckSkipped as exc:
        pytest.skip(str(exc))


class _Contract:
    kind: ClassVar[str]
    plugin_name: ClassVar[str | None] = None  # the registered name (or alias) to test
    plugin_options: ClassVar[dict[str, Any]] = {}  # options to create it with, as in `-o KIND.NAME VALUE`
    registry: ClassVar[Registry | None] = None  # None: the default registry (built-in + installed)

    fixtures: ContractFixtures

    def make_plugin(self) -> Any:
        """A fresh instance of the plugin under test; the default creates `plugin_name` from the registry."""
        return self._spec_subject().make()

    def _spec_subject(self) -> Subject:
        from outrider.testing.report import subject_for

        if not self.plugin_name:
            raise TypeError(f"{type(self).__name__}: set plugin_name, or override make_{self.kind}()")
        spec = (self.registry or registry_module.default_registry()).get(self.kind, self.plugin_name)
        return subject_for(spec, self.fixtures, self.plugin_options)

    def capabilities(self) -> dict[str, Any]:
        """Declared capabilities; instance attributes of the same names take precedence in the checks."""
        return dict(self._spec_subject().capabilities) if self.plugin_name else {}

    def subject(self, fixtures: ContractFixtures) -> Subject:
        self.fixtures = fixtures
        make = getattr(self, f"make_{self.kind}")
        name = self.plugin_name or type(self).__name__
        return Subject(self.kind, name, make, self.capabilities(), fixtures)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # the three contract classes: one test method per check
            for check in CHECKS[cls.kind]:
                setattr(cls, f"test_{check.name}", _test_method(check))


def _test_method(check: Check):
    def test(self, outrider_contract_fixtures: ContractFixtures) -> None:
        __tracebackhide__ = True
        _run(check, self.subject(outrider_contract_fixtures))

    test.__name__ = f"test_{check.name}"
    test.__doc__ = check.description
    return pytest.mark.gpu(test) if check.gpu else test


class BackendContract(_Contract):
    kind = "backend"

    def make_backend(self) -> Any:
        return self.make_plugin()


class DrafterContract(_Contract):
    kind = "drafter"

    def make_drafter(self) -> Any:
        return self.make_plugin()


class AcceptorContract(_Contract):
    kind = "acceptor"

    def make_acceptor(self) -> Any:
        return self.make_plugin()


@dataclass(frozen=True)
class ContractCase:
    """One check against one registered plugin (with one set of options)."""

    kind: str
    name: str
    options: tuple[tuple[str, Any], ...]
    check: Check
    package: str

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kind}:{self.name}{'[' + opts + ']' if opts else ''}:{self.check.name}"

    def run(self, fixtures: ContractFixtures, registry: Registry | None = None) -> None:
        from outrider.testing.report import subject_for

        spec = (registry or registry_module.default_registry()).get(self.kind, self.name)
        _run(self.check, subject_for(spec, fixtures, dict(self.options)))


def registry_cases(registry: Registry | None = None,
                   variants: dict[tuple[str, str], list[dict[str, Any]]] | None = None) -> list[ContractCase]:
    """Every check against every registered plugin; `variants[(kind, name)]` adds runs with other options."""
    registry = registry or registry_module.default_registry()
    cases = []
    for spec in registry.all():
        for options in [{}, *(variants or {}).get((spec.kind, spec.name), [])]:
            for check in CHECKS[spec.kind]:
                cases.append(ContractCase(spec.kind, spec.name, tuple(sorted(options.items())), check, spec.package))
    return cases


def registry_params(registry: Registry | None = None,
                    variants: dict[tuple[str, str], list[dict[str, Any]]] | None = None) -> list[Any]:
    """`registry_cases` as pytest params (GPU checks marked `gpu`), for `@pytest.mark.parametrize("case", ...)`."""
    return [pytest.param(case, id=case.id, marks=[pytest.mark.gpu] if case.check.gpu else [])
            for case in registry_cases(registry, variants)]
