"""The config file: defaults, durations, cross-checks, one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cronoq_server.config import ConfigError, load_config, parse_config

HASH = "ab" * 32
SHARDED: dict[str, Any] = {
    "store": {"path": "/data/{shard}.db"},
    "pools": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "shards": [
        {"name": "east", "number": 1, "pools": ["a", "b"], "endpoint": "http://east:7070"},
        {"name": "west", "number": 2, "pools": ["c"], "endpoint": "https://west:7070"},
    ],
}


def refusal(data: dict[str, Any], path: str = "cronoq.toml") -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, path)
    message = str(err.value)
    assert "\n" not in message
    return message


def sharded(**changes: Any) -> dict[str, Any]:
    return {**SHARDED, **changes}


def test_defaults() -> None:
    for cfg in (parse_config({}), load_config(None)):
        assert (cfg.server.listen, cfg.server.http_listen) == ("127.0.0.1:7070", "127.0.0.1:7080")
        assert not cfg.server.allow_unauthenticated and not cfg.server.insecure_peer_http
        assert (cfg.store.kind, cfg.store.path, cfg.store.url_env) == ("sqlite", "./cronoq.db", "DATABASE_URL")
        assert [p.name for p in cfg.pools] == ["default"]
        pool = cfg.pool("default")
        assert pool is not None
        assert (pool.max_attempts, pool.lease_ttl, pool.retention) == (3, 30.0, 7 * 86400.0)
        assert cfg.limits.max_pending_total is None and cfg.limits.max_pending_per_pool is None
        assert not cfg.sharded and cfg.tokens == [] and cfg.clients == []
    assert parse_config({}).pool("missing") is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("7d", 7 * 86400.0),
        ("2m", 120.0),
        ("1.5h", 5400.0),
        (" 10 s ", 10.0),
        ("45", 45.0),
        (5, 5.0),
        (0.25, 0.25),
    ],
)
def test_durations(value: Any, seconds: float) -> None:
    cfg = parse_config({"pools": [{"name": "p", "timeout": value, "retention": value, "retry_backoff": value}]})
    pool = cfg.pool("p")
    assert pool is not None
    assert pool.timeout == pool.retention == pool.retry_backoff == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("soon", "expected a duration"),
        ("5 weeks", "expected a duration"),
        ("-5s", "expected a duration"),
        ("0s", "must be positive"),
        (0, "must be positive"),
        (True, "expected a duration"),
        ([1], "expected a duration"),
    ],
)
def test_bad_durations(value: Any, problem: str) -> None:
    message = refusal({"pools": [{"name": "p", "lease_ttl": value}]})
    assert message.startswith("cronoq.toml: pools[0].lease_ttl: ") and problem in message


def test_a_sharded_config_is_accepted() -> None:
    cfg = parse_config(sharded(resources=[{"name": "gpu", "shard": "west", "concurrency": 2}]))
    assert cfg.sharded and [s.number for s in cfg.shards] == [1, 2]


@pytest.mark.parametrize(
    ("data", "key", "problem"),
    [
        ({"server": {"bogus": 1}}, "server.bogus", "unknown key"),
        ({"surprise": {}}, "surprise", "unknown key"),
        ({"pools": [{"name": "a"}, {"name": "a"}]}, "pools[1].name", "duplicate value 'a'"),
        ({"pools": [{"name": "bad name"}]}, "pools[0].name", "'bad name'"),
        ({"pools": [{"name": "a", "max_attempts": 0}]}, "pools[0].max_attempts", "greater than or equal to 1"),
        ({"resources": [{"name": "gpu"}]}, "resources[0]", "exactly one of 'concurrency' or 'rate'"),
        ({"resources": [{"name": "gpu", "concurrency": 1, "rate": 2}]}, "resources[0]", "exactly one of"),
        ({"resources": [{"name": "gpu", "concurrency": 1, "burst": 2}]}, "resources[0]", "'burst' applies only"),
        (
            {"resources": [{"name": "gpu", "concurrency": 1}, {"name": "gpu", "rate": 1}]},
            "resources[1].name",
            "duplicate",
        ),
        (
            {"resources": [{"name": "gpu", "concurrency": 1, "shard": "east"}]},
            "resources[0].shard",
            "unknown shard 'east'",
        ),
        ({"store": {"kind": "mysql"}}, "store.kind", "'mysql'"),
        ({"limits": {"max_batch_size": 0}}, "limits.max_batch_size", "greater than or equal to 1"),
        (
            {"tokens": [{"name": "t", "pools": ["*"], "permissions": ["read"]}]},
            "tokens[0]",
            "exactly one of 'sha256' or 'env'",
        ),
        (
            {"tokens": [{"name": "t", "sha256": HASH, "env": "X", "pools": ["*"], "permissions": ["read"]}]},
            "tokens[0]",
            "exactly one of",
        ),
        (
            {"tokens": [{"name": "t", "sha256": "xyz", "pools": ["*"], "permissions": ["read"]}]},
            "tokens[0].sha256",
            "'xyz'",
        ),
        (
            {"tokens": [{"name": "t", "sha256": HASH, "pools": ["nope"], "permissions": ["read"]}]},
            "tokens[0].pools",
            "unknown pool 'nope'",
        ),
        (
            {"tokens": [{"name": "t", "sha256": HASH, "pools": ["*"], "permissions": ["fly"]}]},
            "tokens[0].permissions[0]",
            "'fly'",
        ),
        (
            {"clients": [{"subject": "CN=x", "pools": ["nope"], "permissions": ["read"]}]},
            "clients[0].pools",
            "unknown pool 'nope'",
        ),
        ({"clients": [{"subject": "CN=x", "pools": ["*"]}]}, "clients[0].permissions", "Field required"),
        # Sharding cross-checks.
        (sharded(store={"path": "/data/one.db"}), "store.path", "must contain {shard}"),
        (sharded(store={"path": "{shard}.db", "schema": "cronoq"}), "store.schema", "must contain {shard}"),
        (
            sharded(pools=[{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}]),
            "pools",
            "pool 'd' is in no shard",
        ),
        (
            sharded(shards=[SHARDED["shards"][0], {**SHARDED["shards"][1], "pools": ["c", "b"]}]),
            "shards[1].pools",
            "pool 'b' is already in shard 'east'",
        ),
        (
            sharded(shards=[SHARDED["shards"][0], {**SHARDED["shards"][1], "pools": ["c", "zz"]}]),
            "shards[1].pools",
            "unknown pool 'zz'",
        ),
        (
            sharded(shards=[SHARDED["shards"][0], {**SHARDED["shards"][1], "number": 1}]),
            "shards[1].number",
            "duplicate value 1",
        ),
        (
            sharded(shards=[SHARDED["shards"][0], {**SHARDED["shards"][1], "name": "east"}]),
            "shards[1].name",
            "duplicate value 'east'",
        ),
        (
            sharded(shards=[{**SHARDED["shards"][0], "number": 0}, SHARDED["shards"][1]]),
            "shards[0].number",
            "greater than or equal to 1",
        ),
        (
            sharded(shards=[{**SHARDED["shards"][0], "number": 256}, SHARDED["shards"][1]]),
            "shards[0].number",
            "less than or equal to 255",
        ),
        (
            sharded(shards=[{**SHARDED["shards"][0], "endpoint": "ftp://east:1"}, SHARDED["shards"][1]]),
            "shards[0].endpoint",
            "'ftp://east:1'",
        ),
        (
            sharded(shards=[{"name": "east", "pools": ["a", "b", "c"], "endpoint": "http://e:1"}]),
            "shards[0].number",
            "Field required",
        ),
        (sharded(resources=[{"name": "gpu", "concurrency": 1}]), "resources[0].shard", "required when [[shards]]"),
        (
            sharded(resources=[{"name": "gpu", "concurrency": 1, "shard": "north"}]),
            "resources[0].shard",
            "unknown shard 'north'",
        ),
    ],
)
def test_refusals_name_file_key_and_problem(data: dict[str, Any], key: str, problem: str) -> None:
    message = refusal(data)
    assert message.startswith(f"cronoq.toml: {key}: "), message
    assert problem in message.removeprefix(f"cronoq.toml: {key}: "), message


def test_postgres_needs_no_shard_in_path() -> None:
    parse_config(sharded(store={"kind": "postgres", "schema": "cronoq_{shard}"}))


def test_load_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "cronoq.toml"
    path.write_text(
        '[server]\nlisten = "127.0.0.1:9000"\n\n'
        '[[pools]]\nname = "default"\nlease_ttl = "500ms"\nretention = "7d"\n\n'
        '[[pools]]\nname = "emails"\nmax_attempts = 5\nretry_backoff = 2\n\n'
        "[limits]\nmax_pending_total = 100\n"
    )
    cfg = load_config(str(path))
    assert cfg.server.listen == "127.0.0.1:9000"
    assert [p.name for p in cfg.pools] == ["default", "emails"]
    assert cfg.pools[0].lease_ttl == 0.5 and cfg.pools[1].retry_backoff == 2.0 and cfg.pools[1].max_attempts == 5
    assert cfg.limits.max_pending_total == 100


def test_load_config_refusals_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(missing))}: file not found$"):
        load_config(str(missing))
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\nlisten = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(broken))
    assert str(err.value).startswith(f"{broken}: not valid TOML") and "\n" not in str(err.value)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[pools]]\nname = "default"\ncolour = "blue"\n')
    with pytest.raises(ConfigError) as err:
        load_config(str(unknown))
    assert str(err.value) == f"{unknown}: pools[0].colour: unknown key"


@pytest.mark.parametrize(
    ("key", "longest", "too_long"),
    [
        ("lease_ttl", "1d", "86401s"),
        ("retry_backoff", "30d", "31d"),
        ("retry_backoff_max", "30d", "31d"),
        ("retention", "3650d", "3651d"),
        ("timeout", "7d", "604800001ms"),
    ],
)
def test_every_pool_duration_has_a_finite_range(key: str, longest: str, too_long: str) -> None:
    pool = parse_config({"pools": [{"name": "p", key: longest}, {"name": "q", key: "1ms"}]}).pools
    assert getattr(pool[1], key) == pytest.approx(0.001)
    for value in (too_long, float("inf"), float("nan"), 1e300, 1e-9):
        message = refusal({"pools": [{"name": "p", key: value}]})
        assert (
            message.startswith(f"cronoq.toml: pools[0].{key}: duration must be from 1ms to ") and repr(value) in message
        )


def test_sizes_and_counts_have_a_finite_range() -> None:
    edges = {"max_payload_bytes": 256 << 20, "max_result_bytes": 256 << 20, "max_batch_size": 100_000}
    edges |= {"max_pending_total": 10**12, "max_pending_per_pool": 10**12}
    assert parse_config({"limits": edges}).limits.max_payload_bytes == 256 << 20
    for key, edge in edges.items():
        assert f"limits.{key}: " in refusal({"limits": {key: edge + 1}})
    for resource in ({"concurrency": 1_000_001}, {"rate": float("inf")}, {"rate": 1, "burst": 1_000_001}):
        assert "resources[0]." in refusal({"resources": [{"name": "r", **resource}]})


def test_duplicate_tokens_are_refused() -> None:
    tail = {"pools": ["*"], "permissions": ["read"]}
    same_digest = [{"name": "a", "sha256": HASH, **tail}, {"name": "b", "sha256": HASH.upper(), **tail}]
    assert refusal({"tokens": same_digest}) == "cronoq.toml: tokens[1].sha256: duplicate value, as in tokens[0]"
    same_name = [{"name": "a", "sha256": HASH, **tail}, {"name": "a", "sha256": "cd" * 32, **tail}]
    assert "tokens[1].name: duplicate value 'a'" in refusal({"tokens": same_name})
    same_env = [{"name": "a", "env": "T", **tail}, {"name": "b", "env": "T", **tail}]
    assert "tokens[1].env: duplicate value 'T', as in tokens[0]" in refusal({"tokens": same_env})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read: is a directory"),
        (b"\xff\xfe[server]\n", "not valid TOML: not UTF-8"),
        (b"x = " + b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b"# " + b"x" * (16 << 20), "more than 16 MiB"),
    ],
)
def test_hostile_files_are_one_line(tmp_path: Path, content: bytes | None, problem: str) -> None:
    path = tmp_path / "cronoq.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(f"{path}: ") and problem in str(err.value) and "\n" not in str(err.value)


def test_forward_timeout_is_a_duration_within_its_range() -> None:
    assert parse_config({}).server.forward_timeout == 30.0
    assert parse_config({"server": {"forward_timeout": "2s"}}).server.forward_timeout == 2.0
    for value, problem in (("1h", "from 100ms to 10m"), ("10ms", "from 100ms to 10m")):
        message = refusal({"server": {"forward_timeout": value}})
        assert "server.forward_timeout" in message and problem in message, message


def test_store_pool_size_is_a_count_within_its_range() -> None:
    assert parse_config({}).store.pool_size == 8
    assert parse_config({"store": {"pool_size": 32}}).store.pool_size == 32
    for value, problem in ((0, "greater than or equal to 1"), (1001, "less than or equal to 1000"), ("8", "integer")):
        message = refusal({"store": {"pool_size": value}})
        assert "store.pool_size" in message and problem in message, message


def test_store_step_pool_size_is_a_count_within_its_range() -> None:
    assert parse_config({}).store.step_pool_size == 2
    assert parse_config({"store": {"step_pool_size": 0}}).store.step_pool_size == 0
    for value, problem in ((-1, "greater than or equal to 0"), (101, "less than or equal to 100"), ("2", "integer")):
        message = refusal({"store": {"step_pool_size": value}})
        assert "store.step_pool_size" in message and problem in message, message


def test_log_format_is_text_or_json() -> None:
    assert parse_config({}).server.log_format == "text"
    assert parse_config({"server": {"log_format": "json"}}).server.log_format == "json"
    message = refusal({"server": {"log_format": "logfmt"}})
    assert "server.log_format" in message and "'text' or 'json'" in message and "'logfmt'" in message, message
