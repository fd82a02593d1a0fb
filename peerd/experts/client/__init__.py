"""The calling side of remote experts: a model's MoE layer calls experts other peers serve.

``ExpertClient`` (which experts are live, from their DHT records, ``directory.py``; one batched call per expert
and pass over reused streams, ``streams.py``), ``RemoteMoE`` (the nn.Module with router and autograd bridge,
``layer.py``) and the gating math (``router.py``). It imports nothing of the hosting side
(:mod:`peerd.experts.server`): calls to this peer's own experts go through :class:`~peerd.experts.calls.LocalHost`.
"""

from peerd.experts.client.client import ExpertClient
from peerd.experts.client.layer import RemoteMoE
from peerd.experts.client.router import Router, load_balancing_loss, renormalize, route

__all__ = ["ExpertClient", "RemoteMoE", "Router", "load_balancing_loss", "renormalize", "route"]
