"""`peerd` as it ran before peerd.footprint and the in-process DHT: hivemind's whole package imported, torch's
file_system sharing, and hivemind's DHT in its own child process (as a trainer still runs it).

bench_light.py starts its baseline peer with ``python -m _full_hivemind_peer start ...``, so the baseline and
the light peer are measured beside the same training peer in one run.
"""

from __future__ import annotations

import os
from typing import Any

os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = "file_system"  # hivemind's default; starts torch_shm_manager

import hivemind  # noqa: F401 - the whole package, as `import hivemind.dht` did before

from peerd.cli import main
from peerd.swarm.node import SwarmNode

_create = SwarmNode.create.__func__  # type: ignore[attr-defined]


async def _in_a_child_process(cls: type[SwarmNode], *args: Any, in_process: bool = False, **kwargs: Any) -> Any:
    return await _create(cls, *args, in_process=False, **kwargs)


SwarmNode.create = classmethod(_in_a_child_process)  # type: ignore[method-assign, assignment]

if __name__ == "__main__":
    main()
