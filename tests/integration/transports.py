"""The libp2p transports peerd supports (``swarm.host_maddrs``), as loopback listen addresses for tests that
run over each. QUIC is the stricter one: it drops whatever a stream closed with input unread still held."""

from __future__ import annotations

LISTEN = {"tcp": "/ip4/127.0.0.1/tcp/0", "quic": "/ip4/127.0.0.1/udp/0/quic-v1"}
