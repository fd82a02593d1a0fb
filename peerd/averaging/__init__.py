"""Group formation through the DHT and the weighted all-reduce of 8-bit coded tensors over libp2p streams."""

from peerd.averaging.allreduce import HANDLER_NAME, AllReducer
from peerd.averaging.group import Group, RoundReport

__all__ = ["HANDLER_NAME", "AllReducer", "Group", "RoundReport"]
