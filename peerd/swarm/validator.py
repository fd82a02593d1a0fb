"""The record check inside hivemind's DHT node: forged values are neither stored nor believed.

hivemind keeps, per subkey, the value with the latest expiration, and merges the answers of several nodes
the same way. A forged value the daemon merely dropped after reading would still have displaced the valid
one inside the DHT (a stranger only needs a later expiration). So the DHT node itself runs
:class:`SignedRecordValidator` on every value another node asks it to store, every value it stores for the
daemon, and every answer it gets from another node; hivemind discards a store or a whole answer that fails.
Its rejections are counted where the DHT node runs and fetched by the daemon with :func:`node_drop_counts`; the
signer of a value that passes is a member, which the node's routing table admits (``admission.py``).
"""

from __future__ import annotations

import logging

from hivemind.dht import DHTNode
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from peerd.errors import ProtocolViolation
from peerd.log import RateLimitedLog
from peerd.swarm.admission import Admission
from peerd.swarm.signing import RecordLifetimes, RecordVerifier
from peerd.wire.membership import Membership

__all__ = ["SignedRecordValidator", "node_drop_counts"]

logger = logging.getLogger(__name__)



class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind ships no type information
    """Accepts only values that :class:`RecordVerifier` opens; every peerd value has a subkey."""

    def __init__(self, membership: Membership, lifetimes: RecordLifetimes) -> None:
        self.verifier = RecordVerifier(membership, lifetimes)
        self.admission = Admission(membership)
        # a stranger's node answers every lookup with its junk, under peer ids it mints at will
        self._log = RateLimitedLog(logger)

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 (msgpack raises several types for foreign bytes)
            subkey = value = None
        if not isinstance(subkey, str):
            # peerd stores every value under a subkey: a plain value or a non-text subkey is not ours
            self.verifier.count("malformed")
            self._log("unknown", logging.WARNING, "DHT refused a record: a value without a text subkey")
            return False
        try:
            opened = self.verifier.open(record.key, subkey, value, record.expiration_time)
        except ProtocolViolation as e:
            self._log(str(e.context.get("peer_id", "unknown")), logging.WARNING, "DHT refused a record: %s",
                      e.message[:500])
            return False
        self.admission.prove(opened.signer)
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


async def node_drop_counts(_dht: object, node: DHTNode) -> dict[str, int]:
    """Run where the DHT node runs (``run_coroutine``): the rejections its validator counted, by reason."""
    counts: dict[str, int] = {}
    validators = getattr(node.protocol.record_validator, "_validators", [])  # hivemind's CompositeValidator
    for validator in validators:
        if isinstance(validator, SignedRecordValidator):
            for reason, count in validator.verifier.counts().items():
                counts[reason] = counts.get(reason, 0) + count
    return counts
