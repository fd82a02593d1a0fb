"""One thread runs the model with torch's threads; every other thread of a trainer's daemon runs torch on one
(peerd/threads.py). Checked in a fresh interpreter, since torch's thread counts are the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)

PROBE = """
import asyncio, json, threading, torch
from peerd import threads
configured = threads.configure(3)
counts = {"configured": configured, "main": torch.get_num_threads()}
async def main():
    counts["compute"] = await threads.run(torch.get_num_threads)
    counts["asyncio worker"] = await asyncio.to_thread(torch.get_num_threads)
    tiny = torch.tensor([1e-39])  # subnormal in float32
    counts["compute flushes"] = await threads.run(lambda: (tiny * 1.0).item() == 0.0)
    counts["main flushes"] = (tiny * 1.0).item() == 0.0
asyncio.run(main())
thread = threading.Thread(target=lambda: counts.update(later=torch.get_num_threads()))
thread.start()
thread.join()
print(json.dumps(counts))
"""


def test_only_the_compute_thread_runs_torch_on_several_threads() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=100, env=env,
                         check=True)
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    # the loop's thread, asyncio's workers and any thread started later run torch on one thread; the compute
    # thread alone flushes subnormal floats to zero
    assert counts == {"configured": 3, "main": 1, "compute": 3, "asyncio worker": 1, "later": 1,
                      "compute flushes": True, "main flushes": False}, counts
