"""`peerd` as it ran before peerd.footprint: hivemind's whole package imported, torch's file_system sharing.

bench_light.py starts its baseline peer with ``python -m _full_hivemind_peer start ...``, so the baseline and
the light peer are measured beside the same training peer in one run.
"""

from __future__ import annotations

import os

os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = "file_system"  # hivemind's default; starts torch_shm_manager

import hivemind  # noqa: F401 - the whole package, as `import hivemind.dht` did before

from peerd.cli import main

if __name__ == "__main__":
    main()
