"""`cronoq-server`: serve one shard (gRPC and HTTP in one event loop)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import getpass
import hashlib
import ipaddress
import logging
import os
import re
import signal
import sys
from typing import TextIO
from urllib.parse import urlsplit

from grpc_health.v1 import health_pb2

from . import __version__
from .api.grpc import start_grpc
from .api.http import start_http
from .api.listen import ListenError
from .api.tls import describe
from .auth import MAX_TOKEN_CHARS
from .backup import run_backup, run_restore
from .config import Config, ConfigError, load_config, with_listeners
from .logformat import setup_logging
from .node import Node
from .sharding import ShardRouter
from .store.base import StoreRefused
from .tls_files import check_tls_files
from .tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("cronoq.server")
# A drain answers the calls in flight within this, then releases leadership.
DRAIN_GRACE_S = 10.0
# After releasing leadership, calls still arriving are refused with UNAVAILABLE this long, so
# callers move to another server before the listeners close (a call a closing gRPC server
# has received but not yet handed to a handler would come back CANCELLED).
HANDOFF_S = 0.5


def _is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_startup(config: Config, path: str, shard: str | None) -> None:
    """Refusals that need more than the file: the shard flag and exposure rules."""
    if config.sharded and shard is None:
        names = ", ".join(s.name for s in config.shards)
        raise ConfigError(f"{path}: shards: --shard is required with [[shards]] (one of: {names})")
    if config.sharded and shard not in {s.name for s in config.shards}:
        raise ConfigError(f"{path}: shards: --shard {shard!r} names no [[shards]] entry")
    if not config.sharded and shard is not None:
        raise ConfigError(f"{path}: shards: --shard {shard!r} given but the file has no [[shards]]")
    for i, token in enumerate(config.tokens):
        if token.env is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", os.environ.get(token.env, "")):
            raise ConfigError(
                f"{path}: tokens[{i}].env: variable {token.env!r} is not set to a sha256 hex digest "
                f"(token {token.name!r})"
            )
    if config.store.kind == "postgres" and not config.store.url and not os.environ.get(config.store.url_env):
        raise ConfigError(
            f"{path}: store.url_env: environment variable {config.store.url_env!r} is not set (or give store.url)"
        )
    s = config.server
    if config.clients and (s.tls is None or s.tls.client_ca is None):
        raise ConfigError(
            f"{path}: clients: [[clients]] authenticate by client certificate, which needs "
            "server.tls with client_ca (or use [[tokens]])"
        )
    if not (config.tokens or config.clients or s.allow_unauthenticated):
        for key, listen in (("server.listen", s.listen), ("server.http_listen", s.http_listen)):
            if not _is_loopback(listen):
                raise ConfigError(
                    f"{path}: {key}: {listen!r} is not loopback and no [[tokens]] or [[clients]] are configured "
                    "(set server.allow_unauthenticated = true to allow)"
                )
    check_tls_files(config, path)


def endpoint_port_mismatch(config: Config, shard: str | None) -> str | None:
    """Why this server's gRPC port is not its shard's endpoint port (None: it is, or unsharded):
    other shards forward to the endpoint, so a server there must listen on it, unless a load
    balancer or port mapping sits between (then the warning is expected)."""
    own = next((s for s in config.shards if s.name == shard), None)
    if own is None:
        return None
    url = urlsplit(own.endpoint)
    endpoint_port = url.port or (443 if url.scheme == "https" else 80)
    listen_port = int(config.server.listen.rpartition(":")[2])
    if listen_port == endpoint_port:
        return None
    return (
        f"shard {own.name}: gRPC listens on port {listen_port} ({config.server.listen}) but the shard's "
        f"[[shards]] endpoint is {own.endpoint} (port {endpoint_port}): other shards forward there, so "
        "it must reach this shard's servers (a load balancer, or --listen with that port)"
    )


async def serve(config: Config, shard: str | None) -> int:
    node = Node(config, shard)
    try:
        setup_tracing(config.server.otlp_endpoint, node.shard_name)
    except RuntimeError as err:
        print(f"cronoq-server: {err}", file=sys.stderr)
        return 2
    router = ShardRouter(node)
    try:
        grpc_server, health = await start_grpc(node, config.server.listen, router)
    except (ListenError, ConfigError) as err:
        print(f"cronoq-server: {err}", file=sys.stderr)
        return 2
    try:
        http_runner = await start_http(node, config.server.http_listen, router)
    except (ListenError, ConfigError) as err:
        print(f"cronoq-server: {err}", file=sys.stderr)
        await grpc_server.stop(None)
        return 2
    log.info(
        "cronoq-server %s: shard %s (number %d), pools %s, gRPC %s, HTTP %s, TLS %s, store %s",
        __version__,
        node.shard_name,
        node.shard_number,
        ",".join(node.pools),
        config.server.listen,
        config.server.http_listen,
        describe(config.server.tls),
        node.describe_store(),
    )
    mismatch = endpoint_port_mismatch(config, shard)
    if mismatch:
        log.warning("%s", mismatch)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def set_health(leading: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if leading else health_pb2.HealthCheckResponse.NOT_SERVING
        await health.set("", status)

    async def lead() -> None:
        await node.open_store()
        await node.run_leadership(set_health)

    leading = asyncio.create_task(lead())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({leading, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if leading.done() and leading.exception() is not None:
        log.error("shard %s: cannot lead: %s", node.shard_name, leading.exception())
        code = 2 if isinstance(leading.exception(), StoreRefused) else 1
    else:
        await stopped
        code = 0
    log.info("shard %s: draining (grace %.0fs)", node.shard_name, DRAIN_GRACE_S)
    await health.enter_graceful_shutdown()
    await node.drain()
    if not await node.wait_idle(DRAIN_GRACE_S):
        log.warning("shard %s: calls still in flight after %.0fs; stopping anyway", node.shard_name, DRAIN_GRACE_S)
    leading.cancel()
    await asyncio.gather(leading, return_exceptions=True)
    await node.stop()
    log.info("shard %s: leadership released", node.shard_name)
    await asyncio.sleep(HANDOFF_S)
    await grpc_server.stop(1.0)
    await http_runner.cleanup()
    await router.close()
    shutdown_tracing()
    log.info("shard %s: stopped", node.shard_name)
    return code


def hash_token(stdin: TextIO) -> int:
    """`cronoq-server hash-token`: the sha256 hex of the token on stdin, for [[tokens]] sha256."""
    text = getpass.getpass("token: ") if stdin.isatty() else stdin.read()
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        print("cronoq-server hash-token: no token on stdin", file=sys.stderr)
        return 2
    if len(lines) > 1 and any(line.strip() for line in lines[1:]):
        print("cronoq-server hash-token: more than one line on stdin (one token, one line)", file=sys.stderr)
        return 2
    if not re.fullmatch(r"[\x21-\x7e]+", token) or len(token) > MAX_TOKEN_CHARS:
        print(
            f"cronoq-server hash-token: a token is 1 to {MAX_TOKEN_CHARS} visible ASCII characters "
            "(no spaces, control or non-ASCII characters)",
            file=sys.stderr,
        )
        return 2
    print(hashlib.sha256(token.encode()).hexdigest())
    return 0


def _store_arguments(command: argparse.ArgumentParser) -> None:
    """--config and --shard, accepted after the command too; SUPPRESS keeps a value given before it."""
    command.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="the server's config file")
    command.add_argument(
        "--shard", metavar="NAME", default=argparse.SUPPRESS, help="the shard; required with [[shards]]"
    )


# Buffers from this size up (payloads, results, gRPC messages) are mapped apart and given back
# to the system when freed. glibc would otherwise raise the threshold after the first such free
# and serve later ones from its heaps, which keep what they held: 3,000 submissions of 195 KB
# with two stalled watchers left the server 61-66 MB larger, 40-42 MB with the threshold fixed.
MMAP_THRESHOLD = 128 << 10
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def fix_mmap_threshold() -> None:
    """Fixes glibc's mmap threshold at MMAP_THRESHOLD (elsewhere: nothing)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="cronoq-server",
        description="Serve one shard of cronoq. With no arguments: pool 'default' on SQLite ./cronoq.db, "
        "gRPC on 127.0.0.1:7070, HTTP on 127.0.0.1:7080.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config file (see docs/configuration.md)")
    parser.add_argument("--shard", metavar="NAME", help="the shard to serve; required with [[shards]]")
    # Servers on one host read the same file and differ in these (replicas, or shards).
    parser.add_argument("--listen", metavar="HOST:PORT", help="the gRPC address, in place of server.listen")
    parser.add_argument("--http-listen", metavar="HOST:PORT", help="the HTTP address, in place of server.http_listen")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (time, level, logger, message, shard, exception); "
        "overrides server.log_format",
    )
    parser.add_argument("--version", action="version", version=f"cronoq-server {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "hash-token",
        help="print the sha256 of a token read on stdin (for [[tokens]] sha256)",
        description="Read one token on stdin (prompted for, unechoed, on a terminal) and print its sha256 "
        "in hex: the value of a [[tokens]] entry's sha256, or of the variable its env names. The server "
        'keeps only this digest. Example: printf %s "$TOKEN" | cronoq-server hash-token',
    )
    backup = commands.add_parser(
        "backup",
        help="copy the SQLite store of --config (and --shard) to a file, while the server runs",
        description="A consistent copy of a live SQLite store (SQLite's online backup API: the store as of "
        "one commit; the leader goes on writing), written as mode 0600; never a file the store or its leadership "
        "uses. To restore: cronoq-server restore. PostgreSQL: use pg_dump (docs/operations.md).",
    )
    _store_arguments(backup)
    backup.add_argument("--to", metavar="PATH", required=True, help="the file to write")
    backup.add_argument("--force", action="store_true", help="replace --to if it exists")
    restore = commands.add_parser(
        "restore",
        help="put a backup in the place of the SQLite store of --config (and --shard), every server stopped",
        description="Copies a file made by `cronoq-server backup` into the store's place, the store moved "
        "aside to STORE.replaced-TIME. Refused while a server of the shard runs. Task ids continue past every "
        "id the replaced store could have given (docs/operations.md). PostgreSQL: use pg_restore.",
    )
    _store_arguments(restore)
    restore.add_argument("--from", dest="source", metavar="PATH", required=True, help="the backup to restore")
    args = parser.parse_args(argv)
    if args.command == "hash-token":
        sys.exit(hash_token(sys.stdin))
    if args.command in ("backup", "restore"):
        try:
            config = load_config(args.config)
        except ConfigError as err:
            print(f"cronoq-server {args.command}: {err}", file=sys.stderr)
            sys.exit(2)
        if args.command == "restore":
            sys.exit(run_restore(config, args.config or "<defaults>", args.shard, args.source))
        sys.exit(run_backup(config, args.config or "<defaults>", args.shard, args.to, args.force))
    setup_logging(args.log_level, args.log_format or "text", args.shard)
    try:
        config = with_listeners(load_config(args.config), args.listen, args.http_listen)
        check_startup(config, args.config or "<defaults>", args.shard)
    except ConfigError as err:
        print(f"cronoq-server: {err}", file=sys.stderr)
        sys.exit(2)
    if args.log_format is None and config.server.log_format != "text":
        setup_logging(args.log_level, config.server.log_format, args.shard)
    fix_mmap_threshold()
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(serve(config, args.shard)))
    sys.exit(uvloop.run(serve(config, args.shard)))


if __name__ == "__main__":
    main()
