"""The one error both listeners raise when they cannot bind their address."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket


class ListenError(Exception):
    """A listen address this server cannot bind. The message is one line naming the config key, e.g.
    "server.http_listen: cannot listen on 127.0.0.1:7080: address already in use"."""


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def os_reason(err: OSError) -> str:
    """'address already in use' rather than '[Errno 98] error while attempting to bind on ...'."""
    if isinstance(err, socket.gaierror):
        return f"cannot resolve the host ({err.strerror})"
    if err.errno:
        return os.strerror(err.errno).lower()
    return str(err) or type(err).__name__


def _bind_error(listen: str) -> OSError | None:
    host, port = split_listen(listen)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        return err
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                sock.bind(addr)
        except OSError as err:
            return err
    return None


def precheck_bind(listen: str) -> str:
    """For an IP-literal address: why it cannot be bound ("" if it can, or if unsure). Checked
    before gRPC tries, whose own failure logs a C-core error line and names no reason."""
    try:
        ipaddress.ip_address(split_listen(listen)[0])
    except ValueError:
        return ""  # a name may resolve to addresses gRPC skips: let gRPC decide
    err = _bind_error(listen)
    if err is not None and err.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
        return os_reason(err)
    return ""


def probe_bind(listen: str) -> str:
    """Why `listen` could not be bound, found by trying it with a plain socket."""
    err = _bind_error(listen)
    if err is not None:
        return os_reason(err)
    return "the address could not be bound (it is free now: another process may have held it)"
