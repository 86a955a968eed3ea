"""Configuration: valid files load with their defaults; every bad field is named with its bad value; the
CLI turns a bad config into exit code 2 and one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config.settings import ConfigError, Settings, load_settings, parse_duration, parse_settings

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
        ("policies[0].consistenthash", {}, "policies[0].consistenthash: unknown field (expected one of: adaptive, admission, aliases, circuitBreaker, composite, consistentHash,"),
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


def _known_fields(config: dict) -> list[str]:
    """The fields the parser accepts where `config` has an unknown one, from its own error message."""
    with pytest.raises(ConfigError) as info:
        parse_settings(config)
    return str(info.value).split("expected one of: ", 1)[1].rstrip(")").split(", ")


def test_cli_help_names_every_top_level_and_policy_field(tmp_path: Path) -> None:
    help_text = _cli("router", "--help", cwd=tmp_path).stdout
    top = _known_fields({"noSuchField": 1})
    policy = _known_fields({"policies": [{"name": "p", "noSuchField": 1}]})
    missing = [f for f in top + policy if f not in ("noSuchField",) and f"{f}:" not in help_text]
    assert not missing, f"fleetroute router --help does not show {missing}"


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


# ---- secrets never printed ----------------------------------------------------------------------------------

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        # A URL's credentials are hidden wherever the URL is echoed.
        ({"redis": {"url": f"redis://:{SECRET}@r:99999/0"}}, {}, "redis.url: has an invalid port (want 1 to 65535): "
                                                                 "'redis://***@r:99999/0'"),
        ({"redis": {"url": f"http://fleet:{SECRET}@r:6379"}}, {}, "must be a redis://, rediss:// or unix:// URL, got "
                                                                  "'http://***@r:6379'"),
        ({"redis": f"redis://:{SECRET}@r:6379"}, {}, "redis: must be a mapping, got 'redis://***@r:6379'"),
        ({}, {"REDIS_URL": f"redis://:{SECRET}@r/x"}, "$REDIS_URL: the database (the URL's path) must be an integer"),
        ({"redis": {"sentinel": {"masterName": "m", "addresses": [f"redis://:{SECRET}@s:26379"]}}}, {},
         "redis.sentinel.addresses[0]: must be host:port, got 'redis://***@s:26379'"),
        ({"redis": {"sentinel": {"masterName": "m", "addresses": [f"admin:{SECRET}@s:26379"]}}}, {},
         "must be host:port, got '***@s:26379'"),
        ({"endpoints": [{"id": "e", "url": f"ftp://u:{SECRET}@e:8000", "models": ["m"]}]}, {},
         "endpoints[0].url: must be an http:// or https:// URL with a host, got 'ftp://***@e:8000'"),
        ({"endpoints": [{"id": "e", "url": f"http://u:{SECRET}@e:99999", "models": ["m"]}]}, {},
         "endpoints[0].url: has an invalid port: 'http://***@e:99999'"),
        # A field that names a secret: its value may be the secret itself, pasted by mistake.
        ({"redis": {"url": "redis://r", "passwordEnv": f"{SECRET}!"}}, {},
         "redis.passwordEnv: must be an environment variable name (letters, digits, _) (its value is not repeated"),
        ({"redis": {"url": "redis://r", "passwordEnv": SECRET}}, {},
         "redis.passwordEnv: the environment variable it names is not set or empty (its value is not repeated"),
        ({"redis": {"url": "redis://r", "passwordFile": SECRET}}, {},
         "redis.passwordFile: cannot read the file it names: No such file or directory (its value is not repeated"),
        ({"redis": {"url": "redis://r", "passwordEnv": 2024}}, {}, "redis.passwordEnv: must be a non-empty string, "
                                                                   "got (its value is not repeated"),
        ({"redis": {"sentinel": {"masterName": "m", "addresses": ["s:1"], "passwordEnv": f"{SECRET} x"}}}, {},
         "redis.sentinel.passwordEnv: must be an environment variable name"),
        ({"auth": {"apiKeysEnv": f"sk-{SECRET}"}}, {}, "auth.apiKeysEnv: must be an environment variable name"),
        ({"auth": {"apiKeysFile": f"sk-{SECRET}"}}, {}, "auth.apiKeysFile: cannot read the file it names"),
        ({"auth": {"upstreamApiKeyEnv": SECRET}}, {}, "auth.upstreamApiKeyEnv: the environment variable it names is "
                                                      "not set"),
        ({"admin": {"tokenEnv": SECRET}}, {}, "admin.tokenEnv: the environment variable it names is not set"),
    ],
    ids=["redis-url-bad-port", "redis-url-not-redis", "redis-block-a-url", "redis-url-from-env", "sentinel-a-url",
         "sentinel-user-password", "endpoint-url-not-http", "endpoint-url-bad-port", "password-env-not-a-name",
         "password-env-unset", "password-file-unreadable", "password-env-a-number", "sentinel-password-env",
         "api-keys-env", "api-keys-file", "upstream-key-env", "admin-token-env"],
)
def test_config_errors_never_print_a_secret(config: dict[str, Any], env: dict[str, str], message: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        parse_settings(config)
    assert message in str(info.value)
    assert SECRET not in str(info.value) and "2024" not in str(info.value)


def test_a_variable_name_or_file_path_is_shown_once_it_proves_to_be_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Set or opened, it is a name or a path, not a secret: saying which one is wrong helps the operator.
    monkeypatch.setenv("ENGINE_KEY", "two words")
    with pytest.raises(ConfigError, match=r"^\$ENGINE_KEY: must be one token of visible ASCII characters$"):
        parse_settings({"auth": {"upstreamApiKeyEnv": "ENGINE_KEY"}})
    (tmp_path / "password").write_text("\n")
    with pytest.raises(ConfigError, match=f"redis.passwordFile: '{tmp_path}/password' is empty"):
        parse_settings({"redis": {"url": "redis://r", "passwordFile": str(tmp_path / "password")}})


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://:pw@redis:6379/0", "redis://***@redis:6379/0"),
        ("rediss://user:pw@redis:6380", "rediss://***@redis:6380"),
        ("http://u:p@ss/w@rd@engine:8000/v1", "http://***@engine:8000/v1"),  # an unencoded @ or / in a password
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("user:pw@sentinel:26379", "***@sentinel:26379"),
        ("model@v2", "model@v2"),  # not an address: nothing to hide
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ],
)
def test_redact_url_hides_userinfo_only(text: str, shown: str) -> None:
    from router.config.redaction import redact_url

    assert redact_url(text) == shown


def test_the_help_names_the_builtin_policy_as_the_code_does() -> None:
    from router.cli import ROUTER_EPILOG
    from router.config.settings import FALLBACK_POLICY

    assert f'the built-in "{FALLBACK_POLICY}"' in ROUTER_EPILOG and 'built-in "default"' not in ROUTER_EPILOG


def test_the_helps_redis_fields_are_the_ones_the_parser_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from router.cli import ROUTER_EPILOG

    block = ROUTER_EPILOG[ROUTER_EPILOG.index("  redis: "):ROUTER_EPILOG.index("  logging: ")]
    sentinel_fields = set(re.findall(r"sentinel\.(\w+)", block)) | {"passwordEnv"}
    assert sentinel_fields == {"passwordEnv", "passwordFile"}
    (tmp_path / "pw").write_text("s\n")
    monkeypatch.setenv("SENTINEL_PW", "s")
    for field, value in (("passwordEnv", "SENTINEL_PW"), ("passwordFile", str(tmp_path / "pw"))):
        sentinel = {"masterName": "m", "addresses": ["s:26379"], "db": 0, "tls": False, field: value}
        assert parse_settings({"redis": {"sentinel": sentinel}}).redis.sentinel.password == "s"


def test_an_unknown_top_level_field_error_lists_every_top_level_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"drainConection": "1s"})
    assert str(info.value) == (
        "drainConection: unknown field (expected one of: admin, auth, control, discovery, drainConnections, endpoints, "
        "explain, kvEvents, limits, listen, logging, policies, redis, shutdownGrace, stallDetection, telemetry, tenancy, "
        "tracing, "
        "workers)")


def test_an_unknown_redis_field_error_lists_url() -> None:
    with pytest.raises(ConfigError, match=r"^redis.ur: unknown field \(expected one of: cluster, passwordEnv, "
                                          r"passwordFile, sentinel, url, username\)$"):
        parse_settings({"redis": {"ur": "redis://r"}})


def test_the_example_config_loads_and_each_of_its_policies_routes_a_served_model() -> None:
    settings = load_settings(str(Path(__file__).resolve().parent.parent / "examples" / "router.yaml"))
    served = {model for endpoint in settings.endpoints for model in endpoint.models}
    routed = {next(p.name for p in settings.policies if p.matches(model)) for model in served}
    assert routed == {p.name for p in settings.policies}  # no policy shadowed by an earlier one, none idle
