"""Remote MoE layer, forward + backward, side by side: peerd vs hivemind's RemoteMixtureOfExperts vs local.

Setup (loopback, one run): 4 experts of hivemind's own ``ffn`` block (Linear 256->1024, GELU, Linear, residual
LayerNorm; Adam) on one host, a router picking k=2 experts per token, batches of 32 tokens of width 256.

* peerd: a real ``peerd start`` daemon serving the 4 experts (``experts.module`` = hivemind's FeedforwardBlock
  class), called from this process through a RemoteMoE layer (its own DHT node and p2pd).
* hivemind: ``hivemind.moe.server.background_server`` hosting the same 4 experts in a child process, called
  through ``hivemind.moe.client.moe.RemoteMixtureOfExperts`` (one call per sample and expert).
* local: the same 4 experts and router in this process (forward, backward and the experts' Adam steps).

Prints p50/p90/p99 of one forward+backward at 32 tokens and tokens/s at 512 tokens.

    .venv/bin/python benchmarks/bench_moe.py [--iterations 200]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import uvloop
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peerd.config import MoEConfig, StreamLimits, SwarmConfig
from peerd.experts import ExpertClient, RemoteMoE
from peerd.experts.client.router import Router, renormalize, route
from peerd.launcher import PeerProcess, wait_for
from peerd.swarm.node import SwarmNode
from peerd.tables import format_table
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

HIDDEN, EXPERTS, K, BATCH, BIG_BATCH = 256, 4, 2, 32, 512
EXPERT_CLASS = "hivemind.moe.server.layers.common:FeedforwardBlock"

HOST_CONFIG = f"""
run_name: bench-moe
swarm:
  host_maddrs: ["/ip4/127.0.0.1/tcp/0"]
  roles: [expert_host]
control:
  port: 0
logging:
  level: WARNING
experts:
  uid_prefix: "ffn.0."
  count: {EXPERTS}
  module: "{EXPERT_CLASS}"
  hidden_dim: {HIDDEN}
  optimizer: adam
  lr: 0.0001
  max_grad_norm: null
  threads: 2
"""


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return at(0.50), at(0.90), at(0.99)


def measure(step: Callable[[torch.Tensor], None], batch: int, iterations: int, warmup: int) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, HIDDEN, generator=generator) for _ in range(8)]
    for i in range(warmup):
        step(inputs[i % len(inputs)])
    times = []
    for i in range(iterations):
        started = time.perf_counter()
        step(inputs[i % len(inputs)])
        times.append(time.perf_counter() - started)
    return times


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


# --- local ----------------------------------------------------------------------------------------------------


def local_step_fn() -> Callable[[torch.Tensor], None]:
    from hivemind.moe.server.layers.common import FeedforwardBlock

    torch.manual_seed(0)
    experts = nn.ModuleList(FeedforwardBlock(HIDDEN) for _ in range(EXPERTS))
    router = Router(HIDDEN, EXPERTS)
    optimizers = [torch.optim.Adam(e.parameters(), lr=1e-4) for e in experts]
    alive = torch.ones(EXPERTS, dtype=torch.bool)

    def step(x: torch.Tensor) -> None:
        x = x.clone().requires_grad_(True)
        routing = route(router(x), alive, K)
        outputs = x.new_zeros(x.shape[0], K, HIDDEN)
        for e in range(EXPERTS):  # batched per expert, as a real MoE implementation does
            tokens, slots = (routing.indices == e).nonzero(as_tuple=True)
            if tokens.numel():
                outputs = outputs.index_put((tokens, slots), experts[e](x[tokens]))
        weights = renormalize(routing.gates, torch.ones_like(routing.gates, dtype=torch.bool))
        loss_of((weights.unsqueeze(-1) * outputs).sum(1)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    return step


# --- peerd ----------------------------------------------------------------------------------------------------


class PeerdCaller:
    """This process's side: a DHT node + p2pd on an event loop thread; the layer runs on the main thread."""

    def __init__(self, host_maddr: str) -> None:
        self.loop = uvloop.new_event_loop()  # the daemon, where remote MoE layers really run, uses uvloop
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.layer: RemoteMoE | None = None
        self._run(self._start(host_maddr))

    def _run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _start(self, host_maddr: str) -> None:
        config = SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[host_maddr])
        self.swarm = await SwarmNode.create(config, "bench-moe")
        self.p2p = await self.swarm.dht.replicate_p2p()
        self.client = ExpertClient(self.swarm, StreamGuard(self.p2p, Membership(), StreamLimits()), "bench-moe")
        moe = MoEConfig(num_experts=EXPERTS, k=K, k_min=K, uid_prefix="ffn.0.", timeout=10.0, grace=1.0)
        torch.manual_seed(0)
        self.layer = RemoteMoE(HIDDEN, moe.uids_for(0), moe, self.client)

    def step(self, x: torch.Tensor) -> None:
        assert self.layer is not None
        x = x.clone().requires_grad_(True)
        loss_of(self.layer(x)).backward()

    def close(self) -> None:
        async def stop() -> None:
            await self.client.close()
            await self.p2p.shutdown()
            await self.swarm.shutdown()
            # hivemind's P2P.__del__ needs a running loop: let the last references go here, on the loop thread
            del self.client, self.p2p, self.swarm
            self.layer = None
            gc.collect()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def bench_peerd(iterations: int, big_iterations: int) -> tuple[list[float], list[float], dict]:  # type: ignore[type-arg]
    log_dir = Path(tempfile.mkdtemp(prefix="peerd-bench-moe-"))
    config = log_dir / "host.yaml"
    config.write_text(HOST_CONFIG)
    host = PeerProcess("expert-host", ["--config", str(config)], log_dir)
    caller = None
    try:
        host.wait_ready(60)
        caller = PeerdCaller(host.ready["maddrs"][0])
        uids = caller.layer.uids if caller.layer is not None else []
        wait_for(lambda: all(caller.client.directory.routable(uids, HIDDEN)), 30, "the 4 experts in the DHT")
        small = measure(caller.step, BATCH, iterations, warmup=20)
        big = measure(caller.step, BIG_BATCH, big_iterations, warmup=3)
        served = host.status()["experts"]["server"]["experts"]
        fallback = caller.layer.stats.fallback_tokens if caller.layer is not None else -1
        assert fallback == 0, f"{fallback} tokens fell back: an expert call failed"
        return small, big, served
    finally:
        if caller is not None:
            caller.close()
        host.stop()


# --- hivemind ---------------------------------------------------------------------------------------------------


def bench_hivemind(iterations: int, big_iterations: int) -> tuple[list[float], list[float]]:
    from hivemind.dht import DHT
    from hivemind.moe.client.moe import RemoteMixtureOfExperts
    from hivemind.moe.server.server import background_server

    uids = [f"ffn.{i}" for i in range(EXPERTS)]
    with background_server(
        expert_uids=uids,
        expert_cls="ffn",
        hidden_dim=HIDDEN,
        num_handlers=1,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        optim_cls=lambda p: torch.optim.Adam(p, lr=1e-4),
        max_batch_size=4096,
    ) as server_peer_info:
        dht = DHT(
            initial_peers=[str(m) for m in server_peer_info.addrs],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
        )
        try:
            torch.manual_seed(0)
            moe = RemoteMixtureOfExperts(
                in_features=HIDDEN,
                grid_size=(EXPERTS,),
                dht=dht,
                uid_prefix="ffn.",
                k_best=K,
                k_min=K,
                forward_timeout=30,
                backward_timeout=30,
                timeout_after_k_min=1.0,
            )

            def step(x: torch.Tensor) -> None:
                x = x.clone().requires_grad_(True)
                loss_of(moe(x)).backward()

            small = measure(step, BATCH, iterations, warmup=3)
            big = measure(step, BIG_BATCH, big_iterations, warmup=1)
            return small, big
        finally:
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iterations", type=int, default=200, help="timed forward+backward passes at 32 tokens"
    )
    parser.add_argument("--hivemind-iterations", type=int, default=30, help="the same for hivemind (slow)")
    parser.add_argument("--big-iterations", type=int, default=20, help="passes at 512 tokens (hivemind: 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    # hivemind's client objects (P2P, ControlClient) are collected on the main thread, where their __del__
    # finds no event loop and prints a traceback; that is hivemind's noise, not a measurement problem.
    sys.unraisablehook = lambda _: None
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    print(
        f"MoE layer forward+backward: {EXPERTS} experts of hivemind's ffn (hidden {HIDDEN}) on one host, "
        f"k={K}, loopback, {os.cpu_count()} cores",
        flush=True,
    )
    local_step = local_step_fn()
    local_small = measure(local_step, BATCH, args.iterations, warmup=20)
    local_big = measure(local_step, BIG_BATCH, args.big_iterations, warmup=3)
    print("local done", flush=True)
    peerd_small, peerd_big, served = bench_peerd(args.iterations, args.big_iterations)
    print("peerd done", flush=True)
    hivemind_small, hivemind_big = bench_hivemind(args.hivemind_iterations, 2)
    print("hivemind done\n", flush=True)

    rows = []
    for name, small, big in (
        ("peerd", peerd_small, peerd_big),
        ("hivemind", hivemind_small, hivemind_big),
        ("local", local_small, local_big),
    ):
        p50, p90, p99 = percentiles(small)
        rows.append(
            [
                name,
                len(small),
                f"{p50:.2f}",
                f"{p90:.2f}",
                f"{p99:.2f}",
                f"{BIG_BATCH / statistics.median(big):,.0f}",
            ]
        )
    print(
        format_table(
            ["implementation", "passes", "p50 ms", "p90 ms", "p99 ms", f"tokens/s @{BIG_BATCH}"], rows
        )
    )
    p50 = {row[0]: float(row[2]) for row in rows}
    print(
        f"\npeerd p50 / hivemind p50 = {p50['peerd'] / p50['hivemind']:.3f} (target <= 0.1); "
        f"peerd p50 / local p50 = {p50['peerd'] / p50['local']:.2f} (target <= 5)"
    )
    first = next(iter(served.values()))
    print(
        f"peerd host, expert ffn.0.0: {first['forward']['calls']} forward calls (one per pass, all its tokens), "
        f"mean {first['forward']['mean_batch_tokens']} tokens per computed batch, {first['updates']} Adam updates"
    )


if __name__ == "__main__":
    main()
