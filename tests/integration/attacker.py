"""A member gone bad, for tests only: `python -m tests.integration.attacker start ...` is `peerd start ...` whose
gradient contributions are its true ones times -1000, claiming 10x the samples it computed. Parameter
averaging (rounds with their own codec settings) stays honest, so what is measured is the gradient attack."""

from __future__ import annotations

import sys
from typing import Any

import torch

from peerd.averaging.allreduce import AllReducer
from peerd.cli import main
from tests.integration import undefended

SCALE = -1000.0
WEIGHT_FACTOR = 10.0

_honest_all_reduce = AllReducer.all_reduce


async def _attacking_all_reduce(
    self: AllReducer, group: Any, flat: torch.Tensor, weight: float, *args: Any, **kwargs: Any
) -> Any:
    if kwargs.get("codec_config") is None and len(args) < 2:  # a gradient round
        flat, weight = flat * SCALE, weight * WEIGHT_FACTOR
    return await _honest_all_reduce(self, group, flat, weight, *args, **kwargs)


AllReducer.all_reduce = _attacking_all_reduce  # type: ignore[method-assign]

if __name__ == "__main__":
    if "--undefended" in sys.argv:  # the same attack on a swarm without some defence (undefended.py)
        sys.argv = undefended.switch_off(sys.argv)
    main()
