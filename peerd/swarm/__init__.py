"""Identity, hivemind's DHT and the peer records published in it."""

from peerd.swarm.records import Capabilities, PeerRecord, PeerState, parse_record

__all__ = [
    "Capabilities",
    "PeerRecord",
    "PeerState",
    "parse_record",
]
