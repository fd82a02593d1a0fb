"""peerd.footprint: hivemind's package loads lazily, the DHT's modules import without its averager, optimizer
and MoE server (nor scipy), and the first attribute asked of the package itself loads the whole package.

Each check runs in a fresh interpreter: this test process imported hivemind whole long ago."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, os, sys
    from peerd.footprint import is_lean, lean_hivemind
    lean_hivemind(light=LIGHT)
    import hivemind.dht, hivemind.p2p
    from hivemind.utils.mpfuture import MPFuture
    import hivemind.p2p.p2p_daemon_bindings.p2pclient as client  # asks the package for a half-imported one
    heavy = sorted(name for name in sys.modules
                   if name.split(".")[0] == "scipy" or name.startswith(("hivemind.moe", "hivemind.optim")))
    lean = is_lean(sys.modules["hivemind"])
    future = MPFuture()
    future.set_result(7)
    result = future.result(timeout=5)
    whole = sys.modules["hivemind"].DHT is hivemind.dht.DHT
    print(json.dumps({"heavy": heavy, "lean": lean, "result": result, "whole": whole,
                      "lean_after": is_lean(sys.modules["hivemind"]), "version": sys.modules["hivemind"].__version__,
                      "strategy": os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"], "gogc": os.environ["GOGC"]}))
""")


def probe(light: bool, env: dict[str, str] | None = None) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", PROBE.replace("LIGHT", repr(light))], capture_output=True,
                            text=True, timeout=100, check=False, env=env)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(120)
def test_dht_imports_without_the_rest_of_hivemind_until_the_package_is_asked() -> None:
    found = probe(light=True)
    assert found["heavy"] == []
    assert found["lean"] is True
    assert found["result"] == 7  # MPFuture works with file-descriptor sharing
    assert found["whole"] is True and found["lean_after"] is False
    assert found["version"]
    assert found["strategy"] == "file_descriptor"
    assert found["gogc"] == "25"


@pytest.mark.timeout(120)
def test_settings_from_the_environment_win() -> None:
    import os

    env = {**os.environ, "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_system", "GOGC": "100"}
    env.pop("PYTEST_CURRENT_TEST", None)
    found = probe(light=False, env=env)
    assert found["strategy"] == "file_system"
    assert found["gogc"] == "100"
    env.pop("GOGC")
    assert probe(light=False, env=env)["gogc"] == "50"


LIGHT_PROBE = textwrap.dedent("""
    import json, sys
    from peerd.footprint import lean_hivemind
    lean_hivemind(light=True)
    import peerd.daemon
    from hivemind.dht import DHTNode
    from hivemind.utils import MSGPackSerializer, get_dht_time
    loaded = {name: name in sys.modules for name in ("torch", "numpy", "hivemind.utils.mpfuture")}
    from hivemind.utils import MPFuture  # a name the package's __init__ takes from a module that needs torch
    import hivemind.utils.mpfuture
    print(json.dumps({"loaded": loaded, "node": DHTNode.__module__, "time": get_dht_time() > 0,
                      "serializer": MSGPackSerializer.loads(MSGPackSerializer.dumps([1, "a"])),
                      "future": MPFuture is hivemind.utils.mpfuture.MPFuture, "torch_after": "torch" in sys.modules}))
""")


@pytest.mark.timeout(120)
def test_a_light_peers_daemon_loads_neither_torch_nor_numpy() -> None:
    result = subprocess.run([sys.executable, "-c", LIGHT_PROBE], capture_output=True, text=True, timeout=100,
                            check=False)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["loaded"] == {"torch": False, "numpy": False, "hivemind.utils.mpfuture": False}
    assert found["node"] == "hivemind.dht.node" and found["time"] and found["serializer"] == [1, "a"]
    assert found["future"] and found["torch_after"]  # the rest of the package is still there when asked for
