"""Sybils of one attacker, for tests only: ``python -m tests.integration.sybil start ...`` is ``peerd start``
whose gradient contributions are all one fixed vector, the same in every sybil process (so the reducer gets
identical rows from each), 1000 in every coordinate. Parameter averaging stays honest."""

from __future__ import annotations

import sys
from typing import Any

import torch

from peerd.averaging.allreduce import AllReducer
from peerd.cli import main
from tests.integration import undefended

VALUE = 1000.0

_honest_all_reduce = AllReducer.all_reduce


async def _sybil_all_reduce(
    self: AllReducer, group: Any, flat: torch.Tensor, weight: float, *args: Any, **kwargs: Any
) -> Any:
    if kwargs.get("codec_config") is None and len(args) < 2:  # a gradient round
        flat = torch.full_like(flat, VALUE)
    return await _honest_all_reduce(self, group, flat, weight, *args, **kwargs)


AllReducer.all_reduce = _sybil_all_reduce  # type: ignore[method-assign]

if __name__ == "__main__":
    if "--undefended" in sys.argv:  # the same attack on a swarm without some defence (undefended.py)
        sys.argv = undefended.switch_off(sys.argv)
    main()
