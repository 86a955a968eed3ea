"""The config reader's building blocks: `ConfigError` (a field path and a message), `Fields` (one mapping of the
config, read key by key and checked for unknown keys), and the helpers every block's parser shares (values
shown in errors without secrets or URL credentials, secrets read from a variable or a file, Kubernetes label
selectors).

router/config/settings.py reads the whole file with them; each component that owns a block of the config
(admission, auth, tenants, tracing, explanations, KV events, RoutingPolicy control) parses it with them too,
so that those components need not import the whole reader, which imports them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from router.config.durations import parse_duration
from router.config.redaction import redact_url


class ConfigError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path



class Fields:
    """Reads one mapping of the config, tracking which keys were used so the rest can be reported."""

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(path or "(top level)", f"must be a mapping, got {_show(raw)}")
        self.raw = raw
        self.path = path
        self.used: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.raw.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.raw

    def string(self, key: str, default: str | None = None) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or not value.strip():
            missing = key not in self.raw
            problem = "is required" if missing else f"must be a non-empty string, got {_show(value, key=key)}"
            raise ConfigError(self.at(key), problem)
        return value.strip()

    def integer(self, key: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.at(key), f"must be an integer, got {_show(value, key=key)}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise ConfigError(self.at(key), f"must be {bound}, got {value}")
        return value

    def number(self, key: str, default: float, *, minimum: float, maximum: float | None = None,
               exclusive_minimum: bool = False) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(self.at(key), f"must be a number, got {_show(value, key=key)}")  # .inf and .nan too
        too_low = value <= minimum if exclusive_minimum else value < minimum
        if too_low or (maximum is not None and value > maximum):
            low = f"> {minimum}" if exclusive_minimum else f">= {minimum}"
            bound = f"{low} and <= {maximum}" if maximum is not None else low
            raise ConfigError(self.at(key), f"must be {bound}, got {value}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.at(key), f"must be true or false, got {_show(value, key=key)}")
        return value

    def duration(self, key: str, default: float) -> float:
        value = self.get(key, default)
        seconds = parse_duration(value)
        if seconds is None or seconds <= 0:
            raise ConfigError(self.at(key), f"must be a positive duration like 2s, 500ms or 1.5, got "
                                            f"{_show(value, key=key)}")
        return seconds

    def choice(self, key: str, default: str, options: tuple[str, ...] | list[str]) -> str:
        value = self.get(key, default)
        if value not in options:
            raise ConfigError(self.at(key), f"must be one of {', '.join(options)}; got {_show(value, key=key)}")
        return value

    def sub(self, key: str) -> Fields:
        return Fields(self.get(key), self.at(key))

    def items(self, key: str) -> list[tuple[str, Any]]:
        value = self.get(key, [])
        if value is None:
            value = []
        if not isinstance(value, list):
            raise ConfigError(self.at(key), f"must be a list, got {_show(value, key=key)}")
        return [(f"{self.at(key)}[{i}]", item) for i, item in enumerate(value)]

    def done(self) -> None:
        unknown = [k for k in self.raw if k not in self.used]
        if unknown:
            known = ", ".join(sorted(self.used))
            raise ConfigError(self.at(str(unknown[0])), f"unknown field (expected one of: {known})")


# Fields that name a secret (passwordEnv, passwordFile, tokenEnv, apiKeysEnv, apiKeysFile, upstreamApiKeyEnv).
# An error about one names the field but never repeats what was written there: a password pasted by mistake
# where its variable's name belongs must not land in a log. A value is repeated only once it has proven to be
# a name or a path (the variable is set, the file was opened).
SECRET_FIELD = re.compile(r"password|token|secret|apikey", re.IGNORECASE)
NOT_SHOWN = "(its value is not repeated: this field names a secret)"


def _show(value: Any, *, key: str = "") -> str:
    """A value for an error message: its repr, cut at 60 characters, with a URL's credentials hidden; nothing
    of it for a field that names a secret (`key`)."""
    if key and SECRET_FIELD.search(key):
        return NOT_SHOWN
    text = repr(_redacted(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _redacted(value: Any) -> Any:
    """`value` with the credentials of every URL in it hidden (router/config/redaction.py), nested ones included."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, list | tuple):
        return type(value)(_redacted(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _redacted(v) for k, v in value.items()}
    return value


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _secret(f: Fields, name: str) -> tuple[str | None, str | None]:
    """`<name>Env` or `<name>File`: the secret read now (a file's trailing newline dropped), and its source."""
    env_key, file_key = f"{name}Env", f"{name}File"
    env, path = f.get(env_key), f.get(file_key)
    if env is not None and path is not None:
        raise ConfigError(f.at(file_key), f"give {env_key} or {file_key}, not both")
    if env is not None:
        env = f.string(env_key)
        if not _ENV_NAME.match(env):
            raise ConfigError(f.at(env_key), f"must be an environment variable name (letters, digits, _) {NOT_SHOWN}")
        value = os.environ.get(env, "")
        if not value:
            raise ConfigError(f.at(env_key), f"the environment variable it names is not set or empty {NOT_SHOWN}")
        return value, f"${env}"
    if path is not None:
        path = f.string(file_key)
        try:
            with open(path, encoding="utf-8") as fh:
                value = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f.at(file_key), f"cannot read the file it names: {reason} {NOT_SHOWN}") from None
        value = value.rstrip("\r\n")  # a Secret mounted as a file, or `echo` into one
        if not value:
            raise ConfigError(f.at(file_key), f"{path!r} is empty")
        return value, f"file {path}"
    return None, None


# Kubernetes label selectors, as the API server validates them (apimachinery validation).
_LABEL_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SELECTOR_KEY = r"(?:[a-z0-9.-]{1,253}/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_SELECTOR_REQUIREMENT = re.compile(
    rf"^\s*(?:!?\s*{_SELECTOR_KEY}"  # exists / does not exist
    rf"|{_SELECTOR_KEY}\s*(?:==|=|!=)\s*{_LABEL_VALUE}"
    rf"|{_SELECTOR_KEY}\s+(?:in|notin)\s*\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\))\s*$"
)


def _label_selector_problem(selector: str) -> str | None:
    """Why the API server would refuse the label selector, or None; the requirements are split on commas
    outside parentheses (`app=vllm,tier in (a,b),!canary`)."""
    requirements, depth, start = [], 0, 0
    for i, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            requirements.append(selector[start:i])
            start = i + 1
    requirements.append(selector[start:])
    for requirement in requirements:
        if not _SELECTOR_REQUIREMENT.match(requirement):
            return f"has an invalid requirement {requirement.strip()!r} (expected key, !key, key=value, " \
                   "key!=value, key in (a,b) or key notin (a,b))"
    return None
