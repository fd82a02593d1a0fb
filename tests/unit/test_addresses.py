from __future__ import annotations

import pytest

from peerd.config.addresses import parse_announce_maddr, parse_listen_maddr, parse_peer_maddr, peer_id_of
from peerd.errors import AddressError

PID = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"


@pytest.mark.parametrize(
    "text",
    [f"/ip4/127.0.0.1/tcp/31337/p2p/{PID}", f"/ip6/::1/tcp/1/p2p/{PID}", f"/dns/bootstrap/tcp/31337/p2p/{PID}",
     f"/ip4/127.0.0.1/udp/31337/quic-v1/p2p/{PID}"],
)
def test_valid_peer_addresses(text: str) -> None:
    assert peer_id_of(parse_peer_maddr(text)) == PID


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("garbage", "not a valid multiaddr"),
        ("/ip4/1.2.3/tcp/1", "not a valid multiaddr"),
        ("/ip4/1.2.3.4/tcp/99999", "not a valid multiaddr"),
        ("/ip4/1.2.3.4/tcp/1", "/p2p/"),
        (f"/tcp/1/p2p/{PID}", "must start with"),
        (f"/ip4/1.2.3.4/p2p/{PID}", "transport port"),
        (f"/ip4/1.2.3.4/tcp/0/p2p/{PID}", "port 0"),
        (f"/ip4/1.2.3.4/udp/0/quic-v1/p2p/{PID}", "port 0"),
        (f"/ip4/1.2.3.4/udp/1/p2p/{PID}", "/quic-v1"),
        (f"/ip4/1.2.3.4/udp/1/quic/p2p/{PID}", "QUIC v1 only"),
        ("/ip4/1.2.3.4/tcp/1/p2p/notapeerid", "not a valid multiaddr"),
    ],
)
def test_bad_peer_addresses_name_field_and_value(text: str, reason: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_peer_maddr(text, field="--initial-peers")
    message = str(info.value)
    assert message.startswith("--initial-peers:")
    assert reason in message
    assert info.value.address == text


def test_listen_and_announce_rules() -> None:
    assert str(parse_listen_maddr("/ip4/0.0.0.0/tcp/0")) == "/ip4/0.0.0.0/tcp/0"
    with pytest.raises(AddressError, match="must not contain /p2p/"):
        parse_listen_maddr(f"/ip4/0.0.0.0/tcp/1/p2p/{PID}")
    with pytest.raises(AddressError, match="port 0"):
        parse_announce_maddr("/ip4/203.0.113.7/tcp/0")
    assert str(parse_announce_maddr("/dns4/bootstrap/tcp/31337")) == "/dns4/bootstrap/tcp/31337"
    assert str(parse_listen_maddr("/ip4/0.0.0.0/udp/0/quic-v1")) == "/ip4/0.0.0.0/udp/0/quic-v1"
    with pytest.raises(AddressError, match="QUIC v1 only"):
        parse_listen_maddr("/ip4/0.0.0.0/udp/0/quic")  # the old draft: p2pd would fail to start on it
    with pytest.raises(AddressError, match="port 0"):
        parse_announce_maddr("/ip4/203.0.113.7/udp/0/quic-v1")
