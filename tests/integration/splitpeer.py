"""`peerd start` whose DHT joins through ``SPLIT_BOOTSTRAP`` while its config names other initial peers.

test_split_brain.py runs it as ``python -m tests.integration.splitpeer start ...``: a peer in another DHT than
the initial peers it was told about, which is what a split brain looks like from inside that peer.
"""

from __future__ import annotations

import os
from typing import Any

from peerd.cli import main
from peerd.config import SwarmConfig
from peerd.swarm import bootstrap

_start_dht = bootstrap.start_dht


def _start_elsewhere(config: SwarmConfig, *args: Any) -> Any:
    return _start_dht(config.model_copy(update={"initial_peers": [os.environ["SPLIT_BOOTSTRAP"]]}), *args)


bootstrap.start_dht = _start_elsewhere

if __name__ == "__main__":
    main()
