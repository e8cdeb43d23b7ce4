"""Settings from defaults, a TOML file, `OUTRIDER_*` environment variables and CLI flags.

Precedence: flags > environment > file > defaults. Every resolved value remembers where it came
from, so `--json` can report it. Plugin options live apart from the settings: in the file as
`[options.backend]`, `[options.drafter]`, `[options.acceptor]` tables, on the command line as
`-o KEY VALUE` (KEY is `kind.option`, or a bare option name that exactly one chosen plugin declares).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from outrider.catalog import DEFAULT_MODEL
from outrider.errors import ConfigError
from outrider.hookspecs import PLUGIN_KINDS

__all__ = ["PLUGIN_KINDS", "SETTINGS", "Config", "Setting", "parse_bool", "parse_draft_max", "resolve_config"]

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_bool(value: Any) -> bool:
    """A boolean setting or option from text: 1/true/yes/on, or 0/false/no/off or empty (an empty environment
    variable is off); anything else raises ValueError."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"not a boolean: {value!r}")
    return text in TRUE_WORDS


@dataclass(frozen=True)
class Setting:
    type: type
    default: Any
    help: str
    parse: Any = None  # optional converter from text, for settings that are not a plain type
    minimum: int | None = None  # smallest value accepted, checked wherever the value comes from


def parse_draft_max(value: Any) -> int | str:
    if str(value).strip().lower() == "auto":
        return "auto"
    number = int(value)
    if number < 0:
        raise ValueError
    return number


SETTINGS: dict[str, Setting] = {
    "model": Setting(str, DEFAULT_MODEL, "target model: a catalog name or a .gguf path"),
    "backend": Setting(str, "cpu", "backend plugin"),
    "drafter": Setting(str, "lookup", "drafter plugin (`none` for plain decoding)"),
    "acceptor": Setting(str, "auto", "acceptor plugin; auto = greedy at temperature 0, sampled above"),
    "draft_model": Setting(str, "", "draft model for the draft-model drafter: a catalog name or a .gguf path"),
    "draft_max": Setting(object, "auto", "tokens drafted per round: a number, or auto (chosen each round from "
                         "measured verify cost and acceptance)", parse_draft_max),
    "draft_min": Setting(int, 0, "drop proposals shorter than this (not drafts sampled from q, which stay lossless only whole)"),
    "draft_p_min": Setting(float, 0.0, "drafter-side stop: end the draft where the drafter's largest probability is below this"),
    "max_tokens": Setting(int, 128, "most tokens to generate", minimum=1),
    "temperature": Setting(float, 0.0, "0 = greedy"),
    "top_k": Setting(int, 0, "0 = off"),
    "top_p": Setting(float, 1.0, "1 = off"),
    "min_p": Setting(float, 0.0, "keep tokens at least this times the most probable one's probability; 0 = off"),
    "repeat_penalty": Setting(float, 1.0, "divide a recent token's positive logit by this, multiply a negative one; 1 = off"),
    "presence_penalty": Setting(float, 0.0, "subtract this from a recent token's logit; 0 = off"),
    "frequency_penalty": Setting(float, 0.0, "subtract this times a recent token's count from its logit; 0 = off"),
    "repeat_last_n": Setting(int, 64, "the recent tokens the penalties count: the last N of the context; -1 = all, 0 = off"),
    "seed": Setting(int, None, "random seed; unset = random"),
    "context": Setting(int, 4096, "KV cache length in tokens (capped at the model's context)"),
    "chat": Setting(bool, False, "wrap the prompt in the model's chat template"),
}


@dataclass
class Config:
    values: dict[str, Any]
    sources: dict[str, str]
    options: dict[str, dict[str, Any]] = field(default_factory=lambda: {kind: {} for kind in PLUGIN_KINDS})
    option_sources: dict[str, dict[str, str]] = field(default_factory=lambda: {kind: {} for kind in PLUGIN_KINDS})
    loose_options: dict[str, tuple[Any, str]] = field(default_factory=dict)  # -o KEY VALUE without a kind

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def report(self, resolved: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Every setting and plugin option with its value and source; `resolved` (the chosen plugins' options
        after defaults and conversion) adds the options left at their default, with source "default"."""
        settings = {key: {"value": self.values[key], "source": self.sources[key]} for key in SETTINGS}
        values = resolved or self.options
        options = {kind: {key: {"value": value, "source": self.option_sources[kind].get(key, "default")}
                          for key, value in values.get(kind, {}).items()} for kind in PLUGIN_KINDS}
        return {"settings": settings, "options": options}


def _convert(key: str, value: Any, source: str) -> Any:
    value = _parse(key, value, source)
    minimum = SETTINGS[key].minimum
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(f"{key} from {source} must be at least {minimum} ({SETTINGS[key].help}), got {value!r}")
    return value


def _parse(key: str, value: Any, source: str) -> Any:
    setting = SETTINGS[key]
    if setting.parse is not None and value is not None:
        try:
            return setting.parse(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} from {source} must be a number >= 0 or auto, got {value!r}") from None
    if value is None or isinstance(value, setting.type) and not (setting.type is int and isinstance(value, bool)):
        return value
    try:
        return parse_bool(value) if setting.type is bool else setting.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} from {source} must be a {setting.type.__name__}, got {value!r}") from None


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check the --config path") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def resolve_config(flags: Mapping[str, Any] | None = None, config_file: str | os.PathLike | None = None,
                   environ: Mapping[str, str] | None = None, option_flags: list[tuple[str, str]] = ()) -> Config:
    environ = os.environ if environ is None else environ
    values = {key: setting.default for key, setting in SETTINGS.items()}
    sources = {key: "default" for key in SETTINGS}
    config = Config(values, sources)

    if config_file is not None:
        origin = f"file {Path(config_file).name}"
        data = dict(load_toml(config_file))
        tables = data.pop("options", {})
        unknown = sorted(set(data) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"unknown key '{unknown[0]}' in {config_file}; valid keys: {', '.join(SETTINGS)}, "
                              f"and [options.{'|'.join(PLUGIN_KINDS)}] tables")
        for key, value in data.items():
            values[key], sources[key] = _convert(key, value, origin), origin
        if not isinstance(tables, dict) or set(tables) - set(PLUGIN_KINDS):
            raise ConfigError(f"{config_file}: [options] may only hold tables named {', '.join(PLUGIN_KINDS)}")
        for kind, table in tables.items():
            for key, value in table.items():
                config.options[kind][key], config.option_sources[kind][key] = value, origin

    for key in SETTINGS:
        name = f"OUTRIDER_{key.upper()}"
        if name in environ:
            values[key], sources[key] = _convert(key, environ[name], f"env {name}"), f"env {name}"

    for key, value in (flags or {}).items():
        if key not in SETTINGS:
            raise ConfigError(f"unknown setting '{key}'; valid: {', '.join(SETTINGS)}")
        if value is not None:
            values[key], sources[key] = _convert(key, value, "flag"), "flag"

    for key, value in option_flags:
        kind, _, name = key.rpartition(".")
        if kind and kind not in PLUGIN_KINDS:
            raise ConfigError(f"-o {key}: the prefix must be one of {', '.join(PLUGIN_KINDS)} (or none)")
        if kind:
            config.options[kind][name], config.option_sources[kind][name] = value, "flag -o"
        else:
            config.loose_options[name] = (value, "flag -o")
    return config
