"""Identity, multiaddrs, hivemind's DHT and the peer records published in it."""

from peerd.swarm.addresses import parse_announce_maddr, parse_listen_maddr, parse_peer_maddr
from peerd.swarm.records import Capabilities, PeerRecord, PeerState, parse_record

__all__ = [
    "Capabilities",
    "PeerRecord",
    "PeerState",
    "parse_announce_maddr",
    "parse_listen_maddr",
    "parse_peer_maddr",
    "parse_record",
]
