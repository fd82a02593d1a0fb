"""Remote mixture-of-experts: peers serve experts over libp2p, models call them batched and fault tolerant.

``ExpertServer`` (a host's experts, batching, optimizers, DHT announcements), ``ExpertClient`` (discovery and
batched calls with timeouts and back-off), ``RemoteMoE`` (the nn.Module with router and autograd bridge),
``route`` / ``load_balancing_loss`` (the gating math). Wire schema: ``protocols/peerd_experts.proto``.
"""

from peerd.experts.client import ExpertClient
from peerd.experts.layer import RemoteMoE
from peerd.experts.router import Router, load_balancing_loss, renormalize, route
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
