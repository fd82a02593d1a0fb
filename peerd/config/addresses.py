"""Parsing of user-typed multiaddrs, with errors that name the flag or field and the bad value.

Everything that reaches hivemind/p2pd has passed through here first, so a typo is reported as
``--initial-peers: '/ip4/1.2.3/tcp/1' is not a valid multiaddr: ...`` rather than as a traceback from p2pd.
"""

from __future__ import annotations

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from peerd.errors import AddressError

_NETWORK_PROTOCOLS = {"ip4", "ip6", "dns", "dns4", "dns6"}
_TRANSPORT_PROTOCOLS = {"tcp", "udp"}


def _parse(text: str, field: str) -> Multiaddr:
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{field}: empty multiaddr", field=field, address=text)
    try:
        return Multiaddr(text.strip())
    except (MultiaddrError, ValueError, TypeError) as e:
        raise AddressError(
            f"{field}: {text!r} is not a valid multiaddr ({e}); expected e.g. "
            "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...",
            field=field,
            address=text,
        ) from None


def _protocol_names(maddr: Multiaddr) -> list[str]:
    return [proto.name for proto in maddr.protocols()]


def _require_network_and_transport(maddr: Multiaddr, text: str, field: str) -> None:
    names = _protocol_names(maddr)
    if not names or names[0] not in _NETWORK_PROTOCOLS:
        raise AddressError(
            f"{field}: {text!r} must start with /ip4, /ip6 or /dns (e.g. /ip4/203.0.113.7/tcp/31337)",
            field=field,
            address=text,
        )
    if len(names) < 2 or names[1] not in _TRANSPORT_PROTOCOLS:
        raise AddressError(
            f"{field}: {text!r} needs a transport port right after the host (/tcp/PORT or /udp/PORT/quic-v1)",
            field=field, address=text,
        )
    if names[1] == "udp" and (len(names) < 3 or names[2] != "quic-v1"):
        # p2pd's only UDP transport; it refuses the older draft (/quic) with "no transport for protocol"
        raise AddressError(
            f"{field}: {text!r}: over UDP peers speak QUIC v1 only, so the port must be followed by /quic-v1 "
            "(e.g. /ip4/0.0.0.0/udp/31337/quic-v1)", field=field, address=text,
        )


def parse_peer_maddr(text: str, field: str = "initial_peers") -> Multiaddr:
    """A full address of another peer: host, transport and ``/p2p/<peer id>`` (which p2pd needs to dial)."""
    maddr = _parse(text, field)
    _require_network_and_transport(maddr, text, field)
    names = _protocol_names(maddr)
    if names[-1] != "p2p":
        raise AddressError(
            f"{field}: {text!r} must end with /p2p/<peer id> (copy it from the `maddrs` of the peer's ready "
            "line or `peerd status`)",
            field=field,
            address=text,
        )
    port = maddr.value_for_protocol(names[1])
    if str(port) == "0":
        raise AddressError(f"{field}: {text!r} has port 0, which cannot be dialled", field=field, address=text)
    return maddr


def parse_listen_maddr(text: str, field: str = "host_maddrs") -> Multiaddr:
    """An address to listen on: host and transport, port 0 allowed, no peer id."""
    maddr = _parse(text, field)
    _require_network_and_transport(maddr, text, field)
    if "p2p" in _protocol_names(maddr):
        raise AddressError(f"{field}: {text!r} is a listen address and must not contain /p2p/", field=field,
                           address=text)
    return maddr


def parse_announce_maddr(text: str, field: str = "announce_maddrs") -> Multiaddr:
    """An address others should dial: like a listen address, but with an explicit port."""
    maddr = parse_listen_maddr(text, field)
    names = _protocol_names(maddr)
    if str(maddr.value_for_protocol(names[1])) == "0":
        raise AddressError(
            f"{field}: {text!r} has port 0; announce the port others can actually reach", field=field, address=text
        )
    return maddr


def peer_id_of(maddr: Multiaddr) -> str:
    return str(maddr.value_for_protocol("p2p"))
