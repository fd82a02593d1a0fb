"""Who this DHT node lets into its routing table: in a private swarm, members only.

Kademlia stores a key on the nodes whose ids are nearest it, and hivemind lets every node pick its own id and
adds whoever talks to it to its routing table. So a stranger who knows one member's address, and no secret,
can start a few nodes with ids next to a key's (``<run>.peers``, ``<run>.progress``): they become where every
member stores and looks up that key, take the records and keep none, and the members stop seeing each other
and averaging (``tests/integration/test_dht_eclipse.py``). Refusing the strangers' records does not help: they
store nothing anyway.

Here a node enters the routing table only once it is a member: on the allowlist, and, with a swarm secret,
the signer of a record that passed every check of :class:`~peerd.swarm.validator.SignedRecordValidator` (its
member tag proves the secret; every peer publishes its record in its first seconds). A stranger is never in a
member's table, so no member's answer names it and no lookup or store reaches it; it can still ask members
(their answers name members, whose records are sealed). Initial peers are in the table before this applies:
they are the operator's choice. An open swarm admits anyone, as hivemind does.

What anyone may ask is bounded too: hivemind answers a find or store of any number of keys, and a find's answer
names the nearest nodes for each, so a stranger's find of tens of thousands of random keys holds the node's
loop for work whose answer is too large to send, and a store of one whole dictionary of as many subkeys holds it
to unpack them before any record check. A request about more than ``MAX_KEYS`` keys is refused once parsed; a
peer not (yet) admitted may ask about ``MAX_UNPROVEN_KEYS`` and store no whole dictionary. Its refused stores are
answered "stored nothing" rather than with an error: a member hands a newcomer the keys it should hold (whole
dictionaries) before the newcomer has proof of it, and hivemind drops from its routing table a node whose store
failed; the newcomer gets those records again from their authors' next stores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from peerd.bounded import remember
from peerd.errors import ProtocolViolation
from peerd.wire.membership import Membership

__all__ = ["MAX_KEYS", "MAX_UNPROVEN_KEYS", "Admission", "AdmittingProtocol", "bound_requests"]

# peers a node remembers as proven members; beyond it the least recently proven is forgotten (and proves
# itself again with its next record): only secret holders get in, but they can mint identities
MAX_PROVEN = 16_384
# keys of one DHT find or store: peerd reads and writes one key at a time, and a node hands a newcomer the keys it
# should hold (a few per run and round)
MAX_KEYS = 1024
# the same for a peer not admitted: a newcomer's first lookups and its own record, before a record of its proves it
MAX_UNPROVEN_KEYS = 16
# a member's request this short cannot hold more than MAX_KEYS keys (over 16 bytes each): only a longer one, or
# one from a peer not admitted, is parsed twice
_SHORT = 16 * 1024


class Admission:
    """The members this node has proof of, and how many peers it kept out of its routing table."""

    def __init__(self, membership: Membership, limit: int = MAX_PROVEN) -> None:
        self.membership = membership
        self.limit = limit
        self.kept_out = 0  # requests and answers of peers kept out of the routing table
        self.refused = 0  # requests refused for their number of keys, or a whole dictionary from a peer not admitted
        self._proven: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def prove(self, peer_id: str) -> None:
        """``peer_id`` signed a record that passed every check: it holds the secret (or needs none)."""
        with self._lock:
            remember(self._proven, peer_id, None, self.limit)

    def admits(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may be in this node's routing table."""
        if self.membership.open:
            return True
        if not self.membership.admits(peer_id):
            return False
        if self.membership.secret is None:
            return True  # the allowlist alone: libp2p authenticated the peer id
        with self._lock:
            return peer_id in self._proven


class AdmittingProtocol(DHTProtocol):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's protocol, whose routing table takes only peers that ``admission`` admits; ``admission`` is set
    when the running protocol's class is switched (``stragglers.guard_node``)."""

    admission: Admission

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        """hivemind names a protocol's handlers after its class: this one's are still DHTProtocol's, which the
        node registered before the switch and other peers call (and removes at shutdown)."""
        return str(DHTProtocol._get_handle_name(namespace, method_name))

    async def update_routing_table(self, node_id: DHTID | None, peer_id: PeerID, responded: bool = True) -> Any:
        """hivemind calls this for every request it answers and every answer it gets: a peer that is not a
        member does not get in (one already in, such as an initial peer, is kept up to date)."""
        if responded and peer_id not in self.routing_table and \
                not self.admission.admits(str(peer_id)):
            self.admission.kept_out += 1
            return None
        return await super().update_routing_table(node_id, peer_id, responded)


Unary = Callable[[bytes, PeerID], Awaitable[bytes]]


def bound_requests(protocol: DHTProtocol, admission: Admission) -> None:
    """Refuses, from then on, the finds and stores ``protocol`` answers that ask about more keys than their sender
    may, or store a whole dictionary from a peer ``admission`` does not admit. hivemind registered its handlers
    with p2pd before peerd could wrap them: the wrapper replaces them in the persistent connection's table, where
    each request arrives as bytes with its sender."""
    control = getattr(getattr(protocol.p2p, "_client", None), "control", None)
    handlers: dict[str, Unary] = getattr(control, "unary_handlers", {})
    for method, request_type in (("rpc_find", dht_pb2.FindRequest), ("rpc_store", dht_pb2.StoreRequest)):
        name = DHTProtocol._get_handle_name(None, method)
        if name in handlers:  # a client-mode node answers nothing
            handlers[name] = _bounded(handlers[name], request_type, protocol, admission)


def _bounded(answer: Unary, request_type: type[Message], protocol: DHTProtocol, admission: Admission) -> Unary:
    async def handle(data: bytes, sender: PeerID) -> bytes:
        member = admission.admits(str(sender))
        if member and len(data) <= _SHORT:
            return await answer(data, sender)
        request: Any = request_type.FromString(data)
        why = _refusal(request, member)
        if why is None:
            return await answer(data, sender)
        admission.refused += 1
        if not member and isinstance(request, dht_pb2.StoreRequest):
            return bytes(dht_pb2.StoreResponse(store_ok=[False] * len(request.keys),
                                               peer=protocol.node_info).SerializeToString())
        raise ProtocolViolation(f"{why} from {sender}", peer_id=str(sender))

    return handle


def _refusal(request: Any, member: bool) -> str | None:
    """Why a DHT find or store (``dht_pb2.FindRequest`` or ``StoreRequest``) from a member, or from a peer not
    (yet) admitted, is refused; None if it is not."""
    limit = MAX_KEYS if member else MAX_UNPROVEN_KEYS
    if len(request.keys) > limit:
        return f"a DHT request about {len(request.keys)} keys (at most {limit}" + (
            ")" if member else " before its sender proves membership)")
    if not member and DHTProtocol.IS_DICTIONARY in getattr(request, "subkeys", ()):
        return "a whole dictionary stored by a peer that has not proven membership"
    return None
