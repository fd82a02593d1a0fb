"""Remote mixture-of-experts: peers serve experts over libp2p, models call them batched and fault tolerant.

Two sides that never import each other, over what they share at this level (``calls.py``: the call protocol;
``records.py``: expert records in the DHT; ``stats.py``: call statistics):

- :mod:`peerd.experts.server`: ``ExpertServer`` (a host's experts, batching, optimizers, DHT announcements);
- :mod:`peerd.experts.client`: ``ExpertClient`` (discovery and batched calls with timeouts and back-off),
  ``RemoteMoE`` (the nn.Module with router and autograd bridge), ``route`` / ``load_balancing_loss`` (the
  gating math).

Wire schema: ``protocols/peerd_experts.proto``.
"""

from peerd.experts.client import ExpertClient, RemoteMoE, Router, load_balancing_loss, renormalize, route
from peerd.experts.server import ExpertServer

__all__ = [
    "ExpertClient",
    "ExpertServer",
    "RemoteMoE",
    "Router",
    "load_balancing_loss",
    "renormalize",
    "route",
]
