"""The hosting side of remote experts: a peer serves its experts to callers (``ExpertServer``).

The server validates each call's header, batches concurrent calls per (expert, pass) (``batching.py``), computes
them on worker threads (``workers.py``) through each expert's module and optimizer (``backend.py``,
``modules.py``), keeps a forward's activations for its backward (``stash.py``) and announces its experts in the
DHT. It imports nothing of the calling side (:mod:`peerd.experts.client`).
"""

from peerd.experts.server.server import ExpertServer

__all__ = ["ExpertServer"]
