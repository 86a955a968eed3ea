"""Configuration: valid files load with their defaults; every bad field is named with its bad value; the
CLI turns a bad config into exit code 2 and one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.settings import ConfigError, Settings, load_settings, parse_duration, parse_settings

GOOD: dict[str, Any] = {
    "listen": {"host": "0.0.0.0", "port": 8080},
    "admin": {"host": "127.0.0.1", "port": 9090},
    "endpoints": [{"id": "gpu-0", "url": "http://10.0.0.5:8000", "models": ["llama-3-8b"]}],
    "policies": [
        {
            "name": "default",
            "models": ["*"],
            "strategy": "adaptive",
            "adaptive": {"weights": {"gpu": 0.6, "memory": 0.3, "queue": 0.1}, "maxQueue": 32},
            "consistentHash": {"key": "header:x-session-id"},
        }
    ],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    """A deep copy of GOOD with one field (dotted path, [i] for list items) set or deleted (value=...)."""
    config = yaml.safe_load(yaml.safe_dump(GOOD))
    node: Any = config
    parts = path.replace("[", ".").replace("]", "").split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = parts[-1]
    if value is ...:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return config


def test_the_issue_example_loads_with_defaults() -> None:
    settings = parse_settings(GOOD)
    assert settings.listen.port == 8080 and settings.admin.host == "127.0.0.1"
    (policy,) = settings.policies
    assert policy.strategy == "adaptive"
    assert policy.params.gpu_weight == pytest.approx(0.6) and policy.params.max_queue == 32
    assert policy.timeouts.connect == 5.0 and policy.retries.attempts == 2
    assert settings.max_body_bytes == 16 * 1024 * 1024
    assert settings.endpoints[0].models == ("llama-3-8b",)


def test_empty_file_gives_defaults() -> None:
    assert parse_settings(None) == Settings()


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("listen.port", 70000, "listen.port: must be between 0 and 65535, got 70000"),
        ("listen.port", "http", "listen.port: must be an integer, got 'http'"),
        ("listen.hots", "x", "listen.hots: unknown field"),
        ("endpoints", {"id": "x"}, "endpoints: must be a list"),
        ("endpoints[0].url", "10.0.0.5:8000", "endpoints[0].url: must be an http:// or https:// URL"),
        ("endpoints[0].url", "http://h:99999", "endpoints[0].url: has an invalid port"),
        ("endpoints[0].id", ..., "endpoints[0].id: is required"),
        ("endpoints[0].id", "gpu 0", "endpoints[0].id: must be letters, digits"),
        ("endpoints[0].models", [], "endpoints[0].models: must be a non-empty list of model names"),
        ("endpoints[0].weight", 0, "endpoints[0].weight: must be > 0.0 and <= 1000.0, got 0"),
        # YAML's .inf and .nan are numbers to the parser; every number field refuses them.
        ("endpoints[0].weight", float("nan"), "endpoints[0].weight: must be a number, got nan"),
        ("endpoints[0].tags", 3, "endpoints[0].tags: unknown field (expected one of: id, models, url, weight)"),
        ("policies[0].strategy", "random", "policies[0].strategy: must be one of adaptive, composite, consistent-hash, least-connections, prefix-aware, round-robin; got 'random'"),
        ("policies[0].name", "Default Policy", "policies[0].name: must be a lower-case DNS label"),
        ("policies[0].adaptive.weights.gpu", "high", "policies[0].adaptive.weights.gpu: must be a number >= 0.0 and <= 1000.0, got 'high'"),
        ("policies[0].adaptive.maxQueue", -1, "policies[0].adaptive.maxQueue: must be between 1 and 1000000, got -1"),
        ("policies[0].adaptive.bogus", 1, "policies[0].adaptive.bogus: unknown parameter"),
        ("policies[0].consistentHash.key", "cookie:x", "policies[0].consistentHash.key: must look like 'header:<name>' or 'body:<field>'"),
        ("policies[0].roundRobin", [1], "policies[0].roundRobin: must be a mapping"),
        ("policies[0].roundRobin", {"x": 1}, "policies[0].roundRobin.x: unknown parameter (this strategy takes no parameters)"),
        ("policies[0].consistenthash", {}, "policies[0].consistenthash: unknown field (expected one of: adaptive, admission, circuitBreaker, composite, consistentHash,"),
        ("policies[0].timeouts", {"connect": "soon"}, "policies[0].timeouts.connect: must be a positive duration like 2s, 500ms or 1.5, got 'soon'"),
        ("policies[0].retries", {"attempts": 0}, "policies[0].retries.attempts: must be between 1 and 10, got 0"),
        ("policies[0].models", "llama", "policies[0].models: must be a non-empty list"),
        ("limits", {"maxBodyBytes": 10}, "limits.maxBodyBytes: must be >= 1024, got 10"),
        ("telemetry", {"interval": 0}, "telemetry.interval: must be a positive duration"),
        ("telemetry", {"gpuSource": "nvml"}, "telemetry.gpuSource: must be one of none, sim"),
        ("redis", {"url": "http://x"}, "redis.url: must be a redis://, rediss:// or unix:// URL"),
        ("logging", {"level": "loud"}, "logging.level: must be one of debug, info, warning, error; got 'loud'"),
        ("workers", 0, "workers: must be between 1 and 256, got 0"),
        ("listne", {}, "listne: unknown field"),
    ],
)
def test_bad_fields_are_named_with_their_value(path: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(with_change(path, value))
    assert message in str(info.value)


def test_duplicate_endpoint_ids_and_policy_names_are_rejected() -> None:
    config = with_change("endpoints", GOOD["endpoints"] * 2)
    with pytest.raises(ConfigError, match=r"endpoints\[1\].id: duplicate endpoint id 'gpu-0'"):
        parse_settings(config)
    config = with_change("policies", GOOD["policies"] * 2)
    with pytest.raises(ConfigError, match=r"policies\[1\].name: duplicate policy name 'default'"):
        parse_settings(config)


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"\(top level\): must be a mapping"):
        parse_settings(["a"])


@pytest.mark.parametrize("raw, seconds", [(2, 2.0), (0.5, 0.5), ("500ms", 0.5), ("2s", 2.0), ("1.5m", 90.0), ("1h", 3600.0)])
def test_durations(raw: Any, seconds: float) -> None:
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["soon", "5 parsecs", True, None, [1]])
def test_non_durations(raw: Any) -> None:
    assert parse_duration(raw) is None


def test_environment_overrides_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETROUTE_LISTEN_PORT", "18080")
    monkeypatch.setenv("FLEETROUTE_ADMIN_HOST", "0.0.0.0")
    settings = parse_settings(GOOD)
    assert settings.listen.port == 18080 and settings.admin.host == "0.0.0.0"
    monkeypatch.setenv("FLEETROUTE_LISTEN_PORT", "eighty")
    with pytest.raises(ConfigError, match=r"\$FLEETROUTE_LISTEN_PORT: must be a port number, got 'eighty'"):
        parse_settings(GOOD)


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("listen:\n  port: [8080\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        load_settings(str(path))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=30, cwd=cwd)


@pytest.mark.parametrize(
    "content, message",
    [
        ("policies:\n  - {name: p, strategy: fastest}\n", "policies[0].strategy: must be one of"),
        ("listen: [1, 2]\n", "listen: must be a mapping"),
        ("endpoints: [{id: a, url: 'ftp://x', models: [m]}]\n", "endpoints[0].url: must be an http:// or https:// URL"),
        ("tracing: {enabled: true, sampleRatio: 2}\n", "tracing.sampleRatio: must be >= 0.0 and <= 1.0, got 2"),
    ],
)
def test_cli_bad_config_exits_2_with_one_clear_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(content)
    result = _cli("router", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_cli_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = _cli("router", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_cli_help_documents_the_configuration(tmp_path: Path) -> None:
    result = _cli("router", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for word in ("--config", "--workers", "strategy:", "consistentHash", "maxBodyBytes", "FLEETROUTE_LISTEN_PORT"):
        assert word in result.stdout


@pytest.mark.parametrize("policy", [
    {"stickiness": {"maxLoadFactor": float("inf")}},
    {"strategy": "consistent-hash", "consistentHash": {"maxLoadFactor": float("nan")}},
    {"retries": {"minRetriesPerSecond": float("inf")}},
    {"slowStart": {"aggression": float("nan")}},
    {"strategy": "prefix-aware", "prefixAware": {"sigmaK": float("inf")}},
    {"adaptive": {"weights": {"gpu": float("inf")}}},
], ids=lambda p: next(iter(p.values())) if len(p) == 1 else p["strategy"])
def test_non_finite_numbers_are_config_errors_not_failures_at_request_time(policy) -> None:
    # A NaN passes every comparison and an infinity overflows math.ceil on the pick path: refused here.
    with pytest.raises(ConfigError, match=r"must be a number"):
        parse_settings({"endpoints": [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
                        "policies": [{"name": "p", **policy}], "redis": {"url": None}})
