"""The TOML config file (docs/configuration.md), validated into one immutable tree.

A bad file raises ConfigError with one line naming the file, the key and the problem.
"""

from __future__ import annotations

import re
import tomllib
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.x509.oid import NameOID, ObjectIdentifier
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .core.limits import DEFAULT_MAX_SNOOZES, MAX_ATTEMPTS, MAX_TIMEOUT_MS

UNSHARDED = "unsharded"
PERMISSIONS = ("submit", "read", "cancel", "work", "schedule", "admin")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class ConfigError(Exception):
    """A config file that cannot be served; the message is one line."""


def _parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as "500ms", "30s", "7d"."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '30s', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as '30s' or '7d', got {value!r}")
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {value!r}")
    return seconds


def _duration(shortest: str, longest: str, zero: bool = False) -> BeforeValidator:
    """A duration from shortest to longest: each key's own finite range (inf, nan and 1e300
    once started a server that then failed on use, or failed to start with a traceback).
    zero: 0 (or "0") is allowed too, meaning "never"."""
    low, high = _parse_duration(shortest), _parse_duration(longest)

    def parse(value: Any) -> float:
        if zero and not isinstance(value, bool) and value in (0, "0"):
            return 0.0
        seconds = _parse_duration(value)
        if not low <= seconds <= high:  # also false for nan
            raise ValueError(f"duration must be from {shortest} to {longest}, got {value!r}")
        return seconds

    return BeforeValidator(parse)


# Every duration is at least a millisecond (stores count microseconds); the longest of each:
LeaseTtl = Annotated[float, _duration("1ms", "1d")]  # workers heartbeat a third of it, in uint32 ms
Backoff = Annotated[float, _duration("1ms", "30d")]
Timeout = Annotated[float, _duration("1ms", f"{MAX_TIMEOUT_MS // 86_400_000}d")]  # as a task's timeout_ms
Retention = Annotated[float, _duration("1ms", "3650d", zero=True)]  # 0: kept forever
Debounce = Annotated[float, _duration("1ms", "7d")]  # as a task's debounce_ms
Window = Annotated[float, _duration("1ms", "30d")]  # watch_window and worker_reap_after
ForwardTimeout = Annotated[float, _duration("100ms", "10m")]
ScanTimeout = Annotated[float, _duration("1ms", "1h")]
# Sizes and counts: the largest of each (a payload twice over must fit gRPC's int32 message cap).
MAX_BYTES = 256 << 20
MAX_COUNT = 10**12
MAX_SLOTS = 1_000_000  # a resource's concurrency, burst and starts per second
MAX_CONFIG_BYTES = 16 << 20


def _check_path(value: str) -> str:
    """A file path: not empty, no NUL (open() would raise, not refuse)."""
    if not value:
        raise ValueError("empty; give a file path")
    if "\0" in value:
        raise ValueError(f"NUL character in {value!r}")
    return value


FilePath = Annotated[str, AfterValidator(_check_path)]


def _check_otlp_endpoint(value: str) -> str:
    if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
        raise ValueError(f"{value!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:4318")
    return value


def _check_printable(value: str) -> str:
    """Text told to other servers and clients (in gRPC metadata and files): no control characters."""
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"control character {bad!r} in {value!r}")
    return value


def _check_listen(value: Any) -> Any:
    """A listen address is host:port (IPv6 hosts in brackets), port 0..65535."""
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if not sep or not host.strip("[]") or not (port.isascii() and port.isdigit()) or int(port) > 65535:
            raise ValueError(f"expected host:port with a port from 0 to 65535, got {value!r}")
    return value


Listen = Annotated[str, AfterValidator(_check_listen)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# Attribute types a [[clients]] subject may name (in any case), besides dotted OIDs.
_SUBJECT_ATTRIBUTES = {
    "CN": NameOID.COMMON_NAME,
    "O": NameOID.ORGANIZATION_NAME,
    "OU": NameOID.ORGANIZATIONAL_UNIT_NAME,
    "C": NameOID.COUNTRY_NAME,
    "L": NameOID.LOCALITY_NAME,
    "ST": NameOID.STATE_OR_PROVINCE_NAME,
    "STREET": NameOID.STREET_ADDRESS,
    "DC": NameOID.DOMAIN_COMPONENT,
    "UID": NameOID.USER_ID,
    "EMAILADDRESS": NameOID.EMAIL_ADDRESS,
    "E": NameOID.EMAIL_ADDRESS,
    "SERIALNUMBER": NameOID.SERIAL_NUMBER,
    "SN": NameOID.SURNAME,
    "GN": NameOID.GIVEN_NAME,
    "GIVENNAME": NameOID.GIVEN_NAME,
    "TITLE": NameOID.TITLE,
    "POSTALCODE": NameOID.POSTAL_CODE,
}
_DOTTED_OID = re.compile(r"^[0-2](\.(0|[1-9][0-9]*))+$")


def _split_unescaped(text: str, separators: str) -> list[str]:
    """text cut at every separator that no backslash escapes; escapes are kept as written."""
    parts: list[str] = []
    current, i = "", 0
    while i < len(text):
        if text[i] == "\\":
            current += text[i : i + 2]
            i += 2
            continue
        if text[i] in separators:
            parts.append(current)
            current = ""
        else:
            current += text[i]
        i += 1
    parts.append(current)
    return parts


def _strip_value(value: str) -> str:
    """Unescaped spaces around a value are not part of it (an escaped trailing space is)."""
    value = value.lstrip(" ")
    while value.endswith(" "):
        backslashes = len(value) - 1 - len(value[:-1].rstrip("\\"))
        if backslashes % 2:
            break
        value = value[:-1]
    return value


def subject_string(name: x509.Name) -> str:
    """A certificate's subject as compared with [[clients]] subjects: RFC 4514 (the most specific
    first), with the attributes of a multi-valued RDN in a fixed order."""
    return ",".join("+".join(sorted(a.rfc4514_string() for a in rdn)) for rdn in reversed(name.rdns))


def rfc4514_subject(text: str) -> str:
    """The canonical RFC 4514 string of a distinguished name ("CN=worker-a,O=acme"), the form a
    verified client certificate's subject is compared in. Attribute types may be in any case
    (CN, cn, emailAddress, or dotted OIDs) and separators may have spaces around them; the
    order is kept as written (RFC 4514: the most specific first). Raises ValueError."""
    if not text.strip():
        raise ValueError("empty subject")
    rdns: list[str] = []
    for rdn in _split_unescaped(text, ","):
        avas: list[str] = []
        for ava in _split_unescaped(rdn, "+"):
            kind, sep, value = ava.partition("=")
            name = kind.strip().upper()
            if not sep or not name or "\\" in name:
                raise ValueError(f"{ava.strip()!r} is not TYPE=value")
            oid = _SUBJECT_ATTRIBUTES.get(name)
            if oid is None and not _DOTTED_OID.match(name):
                raise ValueError(f"unknown attribute type {kind.strip()!r}")
            value = _strip_value(value)
            if not value:
                raise ValueError(f"{kind.strip()}: empty value")
            avas.append(f"{(oid or ObjectIdentifier(name)).dotted_string}={value}")
        rdns.append("+".join(avas))
    try:
        return subject_string(x509.Name.from_rfc4514_string(",".join(rdns)))
    except ValueError as err:
        raise ValueError(" ".join(str(err).split()) or "not a valid RFC 4514 string") from None


def _check_subject(value: str) -> str:
    try:
        return rfc4514_subject(value)
    except ValueError as err:
        raise ValueError(f"not a distinguished name such as 'CN=worker-a,O=acme' ({err}), got {value!r}") from None


class TlsConfig(_Strict):
    """Both listeners. With client_ca, every connection must present a certificate it signed."""

    cert: FilePath
    key: FilePath
    client_ca: FilePath | None = None


class PeerTlsConfig(_Strict):
    """This server's channels to other servers (https:// endpoints); system roots without ca."""

    ca: FilePath | None = None
    cert: FilePath | None = None
    key: FilePath | None = None

    @model_validator(mode="after")
    def _pair(self) -> PeerTlsConfig:
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both 'cert' and 'key' (a client certificate and its key), or neither")
        return self


class ServerConfig(_Strict):
    listen: Listen = "127.0.0.1:7070"
    http_listen: Listen = "127.0.0.1:7080"
    advertise: Annotated[str, AfterValidator(_check_printable)] | None = None
    tls: TlsConfig | None = None
    peer_tls: PeerTlsConfig | None = None
    insecure_peer_http: bool = False
    allow_unauthenticated: bool = False
    # With credentials configured, /metrics needs a token with `admin` unless this is true.
    metrics_public: bool = False
    # How long task events are kept in the store for Watch streams to resume from a cursor.
    watch_window: Window = 3600.0
    # A worker that has not heartbeated (or leased, or reported) for this long is removed.
    worker_reap_after: Window = 600.0
    # The longest this server waits for another shard's answer to a call it forwards.
    forward_timeout: ForwardTimeout = 30.0
    # "json": one JSON object per log line, for log shippers (the --log-format flag overrides it).
    log_format: Literal["text", "json"] = "text"
    # Where this server sends a span per API call (OTLP/HTTP: POST {otlp_endpoint}/v1/traces);
    # none when unset. Needs the `otel` extra (pip install 'cronoq-server[otel]').
    otlp_endpoint: Annotated[str, AfterValidator(_check_otlp_endpoint)] | None = None


class StoreConfig(_Strict):
    kind: Literal["sqlite", "postgres"] = "sqlite"
    path: FilePath = "./cronoq.db"
    url_env: str = "DATABASE_URL"
    url: str | None = None
    schema_: str | None = Field(default=None, alias="schema", min_length=1)
    # SQLite: FULL makes each acknowledged write survive power loss, not only a crash.
    synchronous: Literal["full", "normal"] = "full"
    # PostgreSQL: the most connections the leader's pool opens (besides its leadership connection).
    pool_size: int = Field(default=8, ge=1, le=1000)
    # PostgreSQL: connections besides the pool for workers' plain lease and finish statements,
    # which keep the generic plan there (planned once, not at every call); 0: none.
    step_pool_size: int = Field(default=2, ge=0, le=100)
    # Bulk actions' scans at once (more wait): PostgreSQL, connections besides the pools; SQLite, threads.
    bulk_scans: int = Field(default=1, ge=1, le=100)


class PoolConfig(_Strict):
    name: Name
    max_attempts: int = Field(default=3, ge=1, le=MAX_ATTEMPTS)
    lease_ttl: LeaseTtl = 30.0
    retry_backoff: Backoff = 1.0
    retry_backoff_max: Backoff = 300.0
    retry_backoff_multiplier: float = Field(default=2.0, ge=1.0, le=10.0, allow_inf_nan=False)
    # How long ended tasks are kept (with their attempts and events) before the leader purges
    # them; 0: forever. retention_failed: FAILED and EXPIRED ones (default: as retention).
    retention: Retention = 7 * 86400.0
    retention_failed: Retention | None = None
    # What a submission does when its key names a task and it asks no key_mode of its own;
    # "debounce" needs `debounce` (a submission's debounce_ms when it gives none; max_debounce
    # likewise for max_debounce_ms, none when unset).
    default_key_mode: Literal["return_existing", "replace_pending", "debounce"] = "return_existing"
    debounce: Debounce | None = None
    max_debounce: Debounce | None = None
    # Execution timeout of each attempt (none when unset); a task's timeout_ms is capped by it.
    timeout: Timeout | None = None
    # At most this many tasks of one group_key run at once, and leases take the groups with due
    # tasks in turn (none when unset: the pool is one queue by priority, then due time).
    max_running_per_group: int | None = Field(default=None, ge=1, le=MAX_SLOTS)
    # The snoozes a task of the pool may take (TaskSnoozed): one more is taken as a retryable
    # failure, which counts, so a handler that always snoozes ends the task FAILED.
    max_snoozes: int = Field(default=DEFAULT_MAX_SNOOZES, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _debounce_given(self) -> PoolConfig:
        if self.default_key_mode == "debounce" and self.debounce is None:
            raise ValueError(f"pool {self.name!r}: default_key_mode 'debounce' needs 'debounce' (such as '2s')")
        if self.max_debounce is not None and self.debounce is not None and self.max_debounce < self.debounce:
            raise ValueError(f"pool {self.name!r}: 'max_debounce' is shorter than 'debounce'")
        return self


class ResourceConfig(_Strict):
    name: Name
    shard: str | None = None
    concurrency: int | None = Field(default=None, ge=1, le=MAX_SLOTS)
    rate: float | None = Field(default=None, gt=0, le=MAX_SLOTS, allow_inf_nan=False)
    burst: int | None = Field(default=None, ge=1, le=MAX_SLOTS)
    # Each key ("name:key" in a task's resources) has its own slots or bucket of these sizes.
    per_key: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> ResourceConfig:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"resource {self.name!r} needs exactly one of 'concurrency' or 'rate'")
        if self.burst is not None and self.rate is None:
            raise ValueError(f"resource {self.name!r}: 'burst' applies only to a 'rate' resource")
        return self


class LimitsConfig(_Strict):
    max_pending_total: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    max_pending_per_pool: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    max_payload_bytes: int = Field(default=1 << 20, ge=1, le=MAX_BYTES)
    max_result_bytes: int = Field(default=4 << 20, ge=1, le=MAX_BYTES)
    max_batch_size: int = Field(default=1000, ge=1, le=100_000)
    # The results of a task's dependencies, together, that its handler is given (Task.dependency_results).
    max_dependency_results_bytes: int = Field(default=4 << 20, ge=1, le=MAX_BYTES)
    # Bulk calls (Cancel/Retry/DeleteTasks) one caller may have in progress on a shard at once.
    max_bulk_calls: int = Field(default=4, ge=1, le=10_000)
    # A bulk call's scan for the tasks its filter matches is stopped after this long.
    bulk_scan_timeout: ScanTimeout = 10.0


class OutboxConfig(_Strict):
    """An outbox in an application's PostgreSQL database (`cronoq outbox install`): its committed
    rows are submitted, once each, to the pools listed (rows of other pools go to its dead table)."""

    # How the outbox is named in metrics, logs and the snapshot (default: its schema).
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str | None = None
    url_env: str | None = None
    schema_: str = Field(default="cronoq", alias="schema", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    pools: list[str] = Field(min_length=1)
    # Rows relayed in one step (one transaction in the application's database).
    batch: int = Field(default=500, ge=1, le=10_000)
    # How often the outbox is read when no NOTIFY wakes the relay (the only wake-up with notify = false).
    poll_interval: Annotated[float, _duration("10ms", "1h")] = 1.0
    # LISTEN for the insert trigger's NOTIFY; false behind PgBouncer's transaction pooling (polling only).
    notify: bool = True

    @property
    def label(self) -> str:
        return self.name or self.schema_


class ShardConfig(_Strict):
    name: Name
    number: int = Field(ge=1, le=255)
    pools: list[str]
    endpoint: Annotated[str, Field(pattern=r"^https?://[^/]+$")]


class TokenConfig(_Strict):
    name: Annotated[str, Field(min_length=1)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")] | None = None
    env: str | None = None
    pools: list[str]
    permissions: list[Literal["submit", "read", "cancel", "work", "schedule", "admin"]]

    @model_validator(mode="after")
    def _one_source(self) -> TokenConfig:
        if (self.sha256 is None) == (self.env is None):
            raise ValueError(f"token {self.name!r} needs exactly one of 'sha256' or 'env'")
        return self


class ClientConfig(_Strict):
    subject: Annotated[str, AfterValidator(_check_subject)]  # kept in canonical RFC 4514 form
    pools: list[str]
    permissions: list[Literal["submit", "read", "cancel", "work", "schedule", "admin"]]


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    store: StoreConfig = StoreConfig()
    pools: list[PoolConfig] = [PoolConfig(name="default")]
    resources: list[ResourceConfig] = []
    limits: LimitsConfig = LimitsConfig()
    shards: list[ShardConfig] = []
    tokens: list[TokenConfig] = []
    clients: list[ClientConfig] = []
    outboxes: list[OutboxConfig] = []

    @model_validator(mode="after")
    def _cross_check(self) -> Config:
        _check_cross_references(self)
        return self

    @property
    def sharded(self) -> bool:
        return bool(self.shards)

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)


def _unique(items: list[Any], attr: str, where: str) -> None:
    seen: set[Any] = set()
    for i, item in enumerate(items):
        value = getattr(item, attr)
        if value in seen:
            raise ValueError(f"{where}[{i}].{attr}: duplicate value {value!r}")
        seen.add(value)


def _unique_tokens(tokens: list[TokenConfig]) -> None:
    """No two tokens share a digest or a variable: one of them would never be the one matched."""
    seen: dict[tuple[str, str], int] = {}
    for i, token in enumerate(tokens):
        if token.sha256 is not None:
            attr, value, shown = "sha256", token.sha256.lower(), ""
        else:
            attr, value, shown = "env", token.env or "", f" {token.env!r}"
        if (attr, value) in seen:
            raise ValueError(f"tokens[{i}].{attr}: duplicate value{shown}, as in tokens[{seen[attr, value]}]")
        seen[attr, value] = i


def _check_shard_endpoint(i: int, shard: ShardConfig) -> None:
    """scheme://host[:port] and nothing else, refused at start rather than when a call is first
    forwarded there."""
    url = urlsplit(shard.endpoint)
    where = f"shards[{i}].endpoint: shard {shard.name!r}"
    try:
        port = url.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{where}: the port must be from 1 to 65535, got {shard.endpoint!r}")
    if "@" in url.netloc:
        raise ValueError(f"{where}: no user info (the endpoint is told to clients and workers), got {shard.endpoint!r}")
    if not url.hostname:
        raise ValueError(f"{where}: no host, got {shard.endpoint!r}")
    if "?" in shard.endpoint or "#" in shard.endpoint:
        raise ValueError(f"{where}: give scheme://host:port only, got {shard.endpoint!r}")


def _check_cross_references(cfg: Config) -> None:
    if not cfg.pools:
        raise ValueError("pools: at least one [[pools]] entry is needed")
    _unique(cfg.pools, "name", "pools")
    _unique(cfg.resources, "name", "resources")
    _unique(cfg.shards, "name", "shards")
    _unique(cfg.shards, "number", "shards")
    _unique(cfg.clients, "subject", "clients")
    _unique(cfg.tokens, "name", "tokens")
    _unique_tokens(cfg.tokens)
    pool_names = {p.name for p in cfg.pools}
    shard_names = {s.name for s in cfg.shards}
    for i, res in enumerate(cfg.resources):
        if cfg.shards and res.shard is None:
            raise ValueError(f"resources[{i}].shard: required when [[shards]] are configured ({res.name!r})")
        if res.shard is not None and res.shard not in shard_names:
            raise ValueError(f"resources[{i}].shard: unknown shard {res.shard!r}")
    if cfg.shards:
        owner: dict[str, str] = {}
        for i, shard in enumerate(cfg.shards):
            _check_shard_endpoint(i, shard)
            for pool in shard.pools:
                if pool not in pool_names:
                    raise ValueError(f"shards[{i}].pools: unknown pool {pool!r}")
                if pool in owner:
                    raise ValueError(f"shards[{i}].pools: pool {pool!r} is already in shard {owner[pool]!r}")
                owner[pool] = shard.name
        for pool_cfg in cfg.pools:
            if pool_cfg.name not in owner:
                raise ValueError(f"pools: pool {pool_cfg.name!r} is in no shard")
        if cfg.store.kind == "sqlite" and "{shard}" not in cfg.store.path:
            raise ValueError(f"store.path: must contain {{shard}} when sharded, got {cfg.store.path!r}")
        if cfg.store.schema_ is not None and "{shard}" not in cfg.store.schema_:
            raise ValueError(f"store.schema: must contain {{shard}} when sharded, got {cfg.store.schema_!r}")
    for i, outbox in enumerate(cfg.outboxes):
        if (outbox.url is None) == (outbox.url_env is None):
            raise ValueError(f"outboxes[{i}]: give url or url_env (one of them)")
        for pool in outbox.pools:
            if pool not in pool_names:
                raise ValueError(f"outboxes[{i}].pools: unknown pool {pool!r}")
    _unique(cfg.outboxes, "label", "outboxes")
    grants: list[tuple[str, int, list[str]]] = [("tokens", i, t.pools) for i, t in enumerate(cfg.tokens)]
    grants += [("clients", i, c.pools) for i, c in enumerate(cfg.clients)]
    for section, i, pools in grants:
        for pool in pools:
            if pool != "*" and pool not in pool_names:
                raise ValueError(f"{section}[{i}].pools: unknown pool {pool!r}")


def _format_error(path: str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ""
    for part in first["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] not in ("value_error", "missing") and "input" in first:
        msg += f" (got {first['input']!r})"
    return f"{path}: {loc}: {msg}" if loc else f"{path}: {msg}"


def with_listeners(config: Config, listen: str | None, http_listen: str | None) -> Config:
    """config with the listen addresses of the command line (--listen, --http-listen) in place
    of [server]'s; None keeps the file's. Raises ConfigError naming the flag and the value."""
    update: dict[str, str] = {}
    for flag, key, value in (("--listen", "listen", listen), ("--http-listen", "http_listen", http_listen)):
        if value is not None:
            try:
                update[key] = _check_listen(value)
            except ValueError as err:
                raise ConfigError(f"{flag}: {err}") from None
    return config.model_copy(update={"server": config.server.model_copy(update=update)}) if update else config


def parse_config(data: dict[str, Any], path: str = "<config>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(path, err)) from None


def load_config(path: str | None) -> Config:
    """The file's config, or the no-argument embedded default when path is None."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:  # not Path.read_text: a path such as /dev/zero never ends
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES >> 20} MiB; not a config file")
        parsed = tomllib.loads(data.decode())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {(err.strerror or type(err).__name__).lower()}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 (byte {err.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse_config(parsed, path)
