"""The shard router's rules for when a call is not sent to a peer (PeerChannels.refusal)."""

from __future__ import annotations

import pytest

from cronoq_server.auth import ANONYMOUS, Principal
from cronoq_server.config import parse_config
from cronoq_server.sharding.peers import PeerChannels, is_loopback_host

TOKEN = Principal("t", None, frozenset({"submit"}), token="secret")
CERT = Principal("CN=w", None, frozenset({"submit"}), via_certificate=True)


def peers(insecure_peer_http: bool = False) -> PeerChannels:
    return PeerChannels(parse_config({"server": {"insecure_peer_http": insecure_peer_http}}))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("127.0.0.1", True), ("127.8.0.2", True), ("::1", True), ("[::1]", True),
     ("10.0.0.1", False), ("cronoq-gpu.internal", False), ("localhost.example", False), ("", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_loopback_and_https_endpoints_are_always_used() -> None:
    for endpoint in (
        "http://127.0.0.1:7070",
        "http://localhost:7070",
        "http://[::1]:7070",
        "https://gpu.internal:7070",
    ):
        assert peers().refusal(endpoint, TOKEN) is None, endpoint
        assert peers().refusal(endpoint, ANONYMOUS) is None, endpoint


def test_plain_http_to_another_host_only_with_insecure_peer_http() -> None:
    reason = peers().refusal("http://gpu.internal:7070", TOKEN)
    assert reason is not None and "insecure_peer_http" in reason
    assert peers().refusal("http://10.1.2.3:7070", ANONYMOUS) is not None  # refused with or without a token
    assert peers(insecure_peer_http=True).refusal("http://gpu.internal:7070", TOKEN) is None


def test_a_certificate_caller_is_never_forwarded() -> None:
    reason = peers().refusal("https://gpu.internal:7070", CERT)
    assert reason is not None and "client certificate" in reason


def test_a_redirect_never_goes_from_https_to_http_and_needs_a_scheme() -> None:
    assert peers().refusal("http://127.0.0.1:7071", TOKEN, previous="https://gpu.internal:7070") is not None
    assert peers().refusal("https://gpu-2.internal:7070", TOKEN, previous="https://gpu.internal:7070") is None
    assert peers().refusal("127.0.0.1:7071", TOKEN) is not None  # a server.advertise without its scheme
