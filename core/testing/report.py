"""Running the contract checks outside pytest (`outrider check NAME`): subjects built from the registry,
one result per check, and the readable report."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

from outrider import registry as registry_module
from outrider.registry import PluginSpec, Registry
from outrider.testing.checks import CHECKS, Check, CheckSkipped, Subject
from outrider.testing.fixtures import ContractFixtures
from outrider.testing.threads import torch_threads


@dataclass
class CheckResult:
    check: Check
    status: str  # "PASS", "FAIL" or "SKIP"
    message: str = ""
    seconds: float = 0.0


def subject_for(spec: PluginSpec, fixtures: ContractFixtures, options: dict[str, Any] | None = None) -> Subject:
    """A subject that creates `spec`'s plugin with `options`; a drafter that needs a draft model (an MTP head)
    gets the tiny one."""
    settings = dict(options or {})
    needs = spec.capabilities.get("needs", ())
    if spec.kind == "drafter" and "draft_model" in needs and "model" in spec.options:
        settings.setdefault("model", str(fixtures.tiny_draft_llama_path))
    if spec.kind == "drafter" and "mtp_head" in needs and "model" in spec.options:
        settings.setdefault("model", str(fixtures.tiny_mtp_sidecar_path))
    spec.resolve_options(settings)  # an unknown or ill-typed option is the user's error, reported up front
    if spec.kind == "drafter" and spec.capabilities.get("target_architecture") == "gemma4" \
            and "model" in spec.options and "model" not in settings:
        # a Gemma 4 assistant: the tiny one, written on first use by the checks that make one
        make = lambda: spec.create({**settings, "model": str(fixtures.tiny_gemma4_assistant_path)})
    else:
        make = lambda: spec.create(settings)
    return Subject(spec.kind, spec.name, make, dict(spec.capabilities), fixtures)


def run_check(check: Check, subject: Subject) -> CheckResult:
    start = time.perf_counter()
    try:
        check.run(subject)
    except CheckSkipped as exc:
        return CheckResult(check, "SKIP", str(exc), time.perf_counter() - start)
    except AssertionError as exc:
        return CheckResult(check, "FAIL", str(exc) or "assertion failed", time.perf_counter() - start)
    except Exception as exc:  # a crash inside the plugin is a failure of the contract, reported with its origin
        origin = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"raised {type(exc).__name__}: {exc} (at {origin.filename}:{origin.lineno})"
        return CheckResult(check, "FAIL", message, time.perf_counter() - start)
    return CheckResult(check, "PASS", "", time.perf_counter() - start)


def run_contract(subject: Subject) -> list[CheckResult]:
    with torch_threads(1):  # the checks run tiny models: one thread beats OpenMP hand-offs
        return [run_check(check, subject) for check in CHECKS[subject.kind]]


def find_specs(name: str, kind: str | None = None, registry: Registry | None = None) -> list[PluginSpec]:
    """The plugins called `name` (or an alias of it), of `kind` or of every kind; ConfigError if none."""
    registry = registry or registry_module.default_registry()
    kinds = [kind] if kind else list(CHECKS)
    specs = []
    for k in kinds:
        try:
            specs.append(registry.get(k, name))
        except Exception:
            continue
    if not specs:
        from outrider.errors import ConfigError

        if name in registry.broken:  # `outrider check` of a package that failed to import: its import error
            raise ConfigError(registry.broken[name])
        installed = "; ".join(f"{k}s: {', '.join(sorted(registry.plugins[k]))}" for k in kinds)
        what = f"{kind} " if kind else "plugin "
        note = "".join(f"; {problem}" for problem in registry.broken.values())
        raise ConfigError(f"unknown {what}'{name}'; installed {installed}{note}")
    return specs


def format_report(spec: PluginSpec, results: list[CheckResult]) -> str:
    lines = [f"{spec.label} from {spec.package}"]
    width = max(len(r.check.name) for r in results) if results else 0
    for r in results:
        head = f"  {r.status}  {r.check.name:{width}}  {r.seconds:6.2f}s"
        if r.status == "PASS":
            lines.append(head)
        elif r.status == "SKIP":
            lines.append(f"{head}  ({r.message})")
        else:
            lines.append(head)
            lines.extend(f"        {line}" for line in r.message.splitlines())
            lines.append(f"        the contract: {r.check.description}")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = sum(r.seconds for r in results)
    lines.append(f"{len(results)} checks: {counts['PASS']} passed, {counts['FAIL']} failed, "
                 f"{counts['SKIP']} skipped ({total:.1f}s)")
    return "\n".join(lines)
