"""The server says its version (the release's, from its installed distribution) in
GetServerInfo over gRPC and HTTP, in its first log line, and to `--version`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from cronoq.v1 import admin_service_pb2, admin_service_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
RELEASE = (REPO / "VERSION").read_text().strip()


def test_server_info_and_log_name_the_release_version(server: Any) -> None:
    status, info = server.http("GET", "/v1/info")
    assert status == 200 and info["version"] == RELEASE, info
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = admin_service_pb2_grpc.AdminServiceStub(channel).GetServerInfo(
            admin_service_pb2.GetServerInfoRequest(), timeout=10
        )
    assert reply.version == RELEASE
    started = [line for line in server.log().splitlines() if "cronoq-server " in line and "gRPC" in line]
    assert started and f"cronoq-server {RELEASE}: shard" in started[0], server.log()


def test_version_flag_names_the_release_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cronoq_server.main", "--version"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and out.stdout.strip() == f"cronoq-server {RELEASE}", out
