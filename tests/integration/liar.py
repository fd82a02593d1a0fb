"""A member gone bad in its bookkeeping, for tests only: ``python -m tests.integration.liar start --lie NAME
<peerd start arguments>`` is ``peerd start`` (with the swarm's secret, so a member) that lies as LIES says.
Its own checks of what it reads stay honest unless a lie needs them off."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from peerd.cli import main
from peerd.swarm import node
from tests.integration import undefended

DECADES = 30 * 365 * 86400.0


def _far_expirations() -> None:
    """Every value it stores expires in 30 years: its record would outlive it."""
    undefended.DEFENCES["expiration-cap"]()  # its own DHT node takes the values, whoever else refuses them
    honest = node.SwarmNode.store

    async def store(self: node.SwarmNode, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> bool:
        return await honest(self, key, subkey, payload, node.now() + DECADES)

    node.SwarmNode.store = store  # type: ignore[method-assign]


LIES: dict[str, Callable[[], None]] = {
    "expirations": _far_expirations,
}


if __name__ == "__main__":
    at = sys.argv.index("--lie")
    for name in sys.argv[at + 1].split(","):
        LIES[name]()
    sys.argv = sys.argv[:at] + sys.argv[at + 2:]
    main()
