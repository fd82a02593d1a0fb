"""Per-process workers for bench_allreduce.py: one OS process per peer, possibly inside a network namespace.

Run by the harness as
    [ip netns exec NS] python benchmarks/_allreduce_workers.py --backend NAME --rank R --n N --addrs A0,A1,...
        --numel K --reps M --warmup W --rdv DIR [--iface eth0] [--port P]
and prints exactly one line ``BENCH_RESULT {json}`` on stdout (logs go to stderr).

Adding a backend: write ``def my_worker(ctx: WorkerCtx) -> None`` and register it in BACKENDS. The worker

* sets up its transport using ctx.rank, ctx.n, ctx.addrs (peer i's IP is ctx.addrs[i]; bind to ctx.addrs[ctx.rank]),
  ctx.port (a free TCP port on ctx.addrs[0], for a rendezvous service) and ctx.publish/ctx.lookup (a shared
  directory, visible from every namespace, for handing e.g. multiaddrs from rank 0 to the others);
* then loops ``for rep in ctx.repetitions():`` -- each iteration first runs a cross-process barrier, so all peers
  start a repetition together; ctx.input is this rank's tensor (fp32, ctx.numel elements, identical every rep);
* times the all-reduce with ``with ctx.timed(rep):`` (or ctx.record(rep, metric, start, end) with time.monotonic()
  stamps -- CLOCK_MONOTONIC is system-wide, so stamps from different processes/namespaces are comparable);
* calls ``ctx.check(rep, result)`` with the averaged tensor (the mean over peers, not the sum) right after the
  operation: the CPU seconds the worker and its descendants used from the barrier to that call are recorded.

The harness computes each repetition's time as max(end over peers) - min(start over peers) per metric.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# bench_allreduce.py --baseline REV: the "@base" backends run another revision of peerd, exported here
if os.environ.get("PEERD_BENCH_TREE"):
    sys.path.insert(0, os.environ["PEERD_BENCH_TREE"])

# ---------------------------------------------------------------------------------------------------------------
# worker context


def _read_tx_bytes(iface: str | None) -> int | None:
    """Bytes sent on iface (in this process's network namespace), or None when not measurable."""
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        pass
    try:  # /proc/net/dev always reflects the reading process's namespace
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    except OSError:
        pass
    return None


def _cpu_seconds() -> float | None:
    """User+system CPU of this worker and its live descendants (p2pd, hivemind's DHT/averager processes)."""
    try:
        import psutil

        me = psutil.Process()
        return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])
    except Exception:  # noqa: BLE001 - a diagnostic only: a process exiting mid-scan, no psutil, ...
        return None


def make_input(rank: int, numel: int) -> torch.Tensor:
    """Rank-specific standard-normal data (independent per rank, like real gradients rather than scaled copies)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float32)


@dataclass
class WorkerCtx:
    backend: str
    rank: int
    n: int
    addrs: list[str]
    numel: int
    reps: int
    warmup: int
    rdv: Path
    iface: str | None = None
    port: int = 29500
    transport: str = "tcp"  # libp2p transport of the p2pd-based backends: tcp or quic
    input: torch.Tensor = field(init=False)
    expected: torch.Tensor = field(init=False)
    records: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.input = make_input(self.rank, self.numel)
        expected = torch.zeros(self.numel, dtype=torch.float64)
        for r in range(self.n):
            expected += make_input(r, self.numel) if r != self.rank else self.input
        self.expected = (expected / self.n).to(torch.float32)

    @property
    def addr(self) -> str:
        return self.addrs[self.rank]

    @property
    def listen_maddr(self) -> str:
        """Where this rank's p2pd listens (p2pd's default is 127.0.0.1, unreachable from other namespaces)."""
        return f"/ip4/{self.addr}/udp/0/quic-v1" if self.transport == "quic" else f"/ip4/{self.addr}/tcp/0"

    # -- rendezvous through a directory every process sees (namespaces share the filesystem) --
    def publish(self, key: str, value) -> None:
        tmp = self.rdv / f".{key}.{self.rank}.tmp"
        tmp.write_text(json.dumps(value))
        tmp.rename(self.rdv / f"{key}.json")

    def lookup(self, key: str, timeout: float = 120.0):
        path = self.rdv / f"{key}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: nobody published {key!r} within {timeout}s")
            time.sleep(0.01)
        return json.loads(path.read_text())

    def barrier(self, name: str, timeout: float = 600.0) -> None:
        (self.rdv / f"barrier-{name}-{self.rank}").touch()
        deadline = time.monotonic() + timeout
        while not all((self.rdv / f"barrier-{name}-{r}").exists() for r in range(self.n)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: barrier {name!r} timed out")
            time.sleep(0.002)

    # -- the measured loop --
    def repetitions(self) -> Iterator[int]:
        """Yields rep indices 0..warmup+reps-1 (the first ``warmup`` are discarded), aligned by a barrier."""
        for rep in range(self.warmup + self.reps):
            self.barrier(f"rep{rep}")
            self._rep_tx0 = _read_tx_bytes(self.iface)
            self._rep_cpu0 = _cpu_seconds()
            self._rep_t0 = time.monotonic()
            yield rep
            rec = self._rec(rep)
            tx1 = _read_tx_bytes(self.iface)
            if self._rep_tx0 is not None and tx1 is not None:
                rec["tx_bytes"] = tx1 - self._rep_tx0  # everything this peer sent during the rep (wire bytes)
        self.barrier("done")

    def _rec(self, rep: int) -> dict:
        while len(self.records) <= rep:
            self.records.append({"rep": len(self.records), "warmup": len(self.records) < self.warmup, "metrics": {}})
        return self.records[rep]

    def record(self, rep: int, metric: str, start: float, end: float) -> None:
        self._rec(rep)["metrics"][metric] = [start, end]

    @contextlib.contextmanager
    def timed(self, rep: int, metric: str = "allreduce"):
        start = time.monotonic()
        yield
        self.record(rep, metric, start, time.monotonic())

    def fail(self, rep: int, error: str) -> None:
        self._rec(rep)["error"] = error

    def check(self, rep: int, result: torch.Tensor) -> None:
        cpu1 = _cpu_seconds()
        rec = self._rec(rep)
        if self._rep_cpu0 is not None and cpu1 is not None:
            rec["cpu_s"] = cpu1 - self._rep_cpu0  # barrier -> result in hand: the operation and its bookkeeping
        diff = (result.to(torch.float32) - self.expected).abs()
        rec["max_abs_err"] = float(diff.max())
        rec["rel_l2_err"] = float(diff.norm() / self.expected.norm())
        rec["bad_frac"] = float((diff > BACKENDS[self.backend.split("@")[0]].tolerance).float().mean())  # share of wrong elements


# ---------------------------------------------------------------------------------------------------------------
# backends


def gloo_worker(ctx: WorkerCtx) -> None:
    """torch.distributed gloo all_reduce(SUM) then /n, on a TCP store at addrs[0]:port."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{ctx.addrs[0]}:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.n, timeout=datetime.timedelta(seconds=300))
    try:
        x = torch.empty_like(ctx.input)
        for rep in ctx.repetitions():
            x.copy_(ctx.input)
            with ctx.timed(rep):
                dist.all_reduce(x, op=dist.ReduceOp.SUM)
                x.div_(ctx.n)
            ctx.check(rep, x)
    finally:
        dist.destroy_process_group()


def hivemind_worker(ctx: WorkerCtx) -> None:
    """hivemind DecentralizedAverager, NoCompression, one group of exactly n peers per step.

    Metrics per rep: ``step`` = averager.step() wall time (matchmaking + all-reduce + handing results back),
    from the common barrier to the return of step() on each peer; ``allreduce`` = time spent inside the averager
    process's _aggregate_with_group (load balancing + butterfly all-reduce + in-place update of the tensor),
    stamped in the averager's own process; ``matchmaking`` = barrier -> entering _aggregate_with_group.
    """
    import multiprocessing as mp

    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression.base import NoCompression
    from hivemind.dht import DHT

    class TimedAverager(DecentralizedAverager):
        """Stamps the all-reduce proper in the averager's background process and ships it to the parent."""

        def __init__(self, *args, **kwargs):
            self.span_queue = mp.Queue()  # created before the fork in start(), so both sides share it
            super().__init__(*args, **kwargs)

        async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
            start = time.monotonic()
            try:
                return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            finally:
                self.span_queue.put((start, time.monotonic(), len(group_info.peer_ids)))

    if os.environ.get("BENCH_HIVEMIND_DEBUG"):  # why a part failed is only logged at DEBUG level
        import logging

        for name in ("hivemind.averaging.allreduce", "hivemind.averaging.averager", "hivemind.averaging.partition"):
            logging.getLogger(name).setLevel(logging.DEBUG)

    # Only our own peers: no NAT port mapping (UPnP/NAT-PMP would probe the LAN gateway from the root namespace),
    # no relays, no AutoNAT.
    p2p_kwargs = {"nat_port_map": False, "use_relay": False, "auto_nat": False}
    host_maddrs = [ctx.listen_maddr]
    if ctx.rank == 0:
        dht = DHT(host_maddrs=host_maddrs, start=True, **p2p_kwargs)
        ctx.publish("maddrs", [str(m) for m in dht.get_visible_maddrs()])
    else:
        dht = DHT(initial_peers=ctx.lookup("maddrs"), host_maddrs=host_maddrs, start=True, **p2p_kwargs)

    tensor = ctx.input.clone()
    min_mm = float(os.environ.get("BENCH_HIVEMIND_MIN_MM", "3.0"))
    averager = TimedAverager(
        [tensor], dht, start=True, prefix="bench_allreduce",
        target_group_size=ctx.n, min_group_size=ctx.n,
        min_matchmaking_time=min_mm, request_timeout=1.0,
        compression=NoCompression(),
        # hivemind requires sender_timeout < reducer_timeout whenever reducer_timeout is set; both are generous
        # (a 64 MB round over 100 Mbit takes ~10 s, but any single part arrives well within these).
        sender_timeout=60.0, reducer_timeout=120.0, allreduce_timeout=600.0,
    )
    try:
        ctx.barrier("averagers-up")
        for rep in ctx.repetitions():
            with averager.get_tensors() as tensors:
                tensors[0].copy_(ctx.input)
            while not averager.span_queue.empty():
                averager.span_queue.get_nowait()
            start = time.monotonic()
            try:
                # 1.1.12 raises AllreduceException when no group was found (instead of returning None)
                averager.step(timeout=60.0, allow_retries=True)
            except Exception as e:  # noqa: BLE001 - record and go on with the next rep
                ctx.record(rep, "step", start, time.monotonic())
                ctx.fail(rep, f"{type(e).__name__}: {e}")
                continue
            ctx.record(rep, "step", start, time.monotonic())
            try:
                span_start, span_end, group_size = averager.span_queue.get(timeout=10)
                ctx.record(rep, "allreduce", span_start, span_end)
                ctx.record(rep, "matchmaking", start, span_start)
                if group_size != ctx.n:
                    ctx.fail(rep, f"group of {group_size} peers, expected {ctx.n}")
            except Exception:  # noqa: BLE001
                ctx.fail(rep, "no all-reduce span reported by the averager process")
            with averager.get_tensors() as tensors:
                ctx.check(rep, tensors[0])
    finally:
        averager.shutdown()
        dht.shutdown()


@dataclass(frozen=True)
class Backend:
    worker: Callable[[WorkerCtx], None]
    tolerance: float  # max |result - exact mean| accepted as correct
    # (numel, n) -> payload bytes each peer sends in one round by the algorithm (None if unknown)
    payload_bytes: Callable[[int, int], float | None]
    metrics: tuple[str, ...] = ("allreduce",)  # in display order; "allreduce" is the one compared against gloo
    reference: bool = False  # moves bytes only (no result to check): a floor for the others, not an all-reduce


@contextlib.contextmanager
def _p2p_on_loop(ctx: WorkerCtx, name: str,
                 identity: Path | None = None) -> Iterator[tuple[Any, Callable[[Any], Any], list[str]]]:
    """This worker's hivemind P2P (its own p2pd, listening on its namespace's address, with the key in
    ``identity`` if given) bootstrapped from rank 0's, on a uvloop thread; yields (p2p, run, every rank's peer
    id) where run(coro) waits for coro on that loop. The loop keeps serving other peers' streams between the
    worker's own calls."""
    import asyncio
    import threading

    import uvloop
    from hivemind.p2p import P2P

    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    options: dict[str, Any] = {"host_maddrs": [ctx.listen_maddr], "nat_port_map": False,
                               "use_relay": False, "auto_nat": False}
    if identity is not None:
        options["identity_path"] = str(identity)
    if ctx.rank != 0:
        options["initial_peers"] = ctx.lookup(f"{name}-maddrs")
    p2p = run(P2P.create(**options))
    try:
        if ctx.rank == 0:
            ctx.publish(f"{name}-maddrs", [str(m) for m in run(p2p.get_visible_maddrs())])
        ctx.publish(f"{name}-id-{ctx.rank}", str(p2p.peer_id))
        yield p2p, run, [ctx.lookup(f"{name}-id-{r}") for r in range(ctx.n)]
    finally:
        run(p2p.shutdown())
        loop.call_soon_threadsafe(loop.stop)


def peerd_worker(ctx: WorkerCtx, secret: bytes | None = None, aggregation: str | None = None) -> None:
    """peerd's own all-reduce: 8-bit blockwise codec (+ error feedback off: one-shot data), reduce-scatter and
    all-gather over libp2p streams through hivemind's P2P; each peer is its own process with its own p2pd.
    With ``secret``, every stream starts with the membership handshake of a private swarm; ``aggregation``
    overrides averaging.aggregation (default: the config's robust default)."""
    import inspect

    from hivemind.p2p import P2P

    from peerd.averaging.allreduce import AllReducer
    from peerd.averaging.group import Group
    from peerd.config import AveragingConfig, StreamLimits
    from peerd.wire.guard import StreamGuard
    from peerd.wire.membership import Membership

    # a revision whose all-reduce verifies reductions certifies its signing key with the peer's identity key
    verified = "identity" in inspect.signature(AllReducer.__init__).parameters
    identity = ctx.rdv / f"identity-{ctx.rank}"
    P2P.generate_identity(str(identity))
    from peerd.wire import blockwise

    kernel = blockwise.kernel() if hasattr(blockwise, "kernel") else "torch"
    print(f"peerd from {inspect.getfile(AllReducer)}, verified reductions: {verified}, codec kernel: {kernel}",
          file=sys.stderr)
    with _p2p_on_loop(ctx, "peerd", identity) as (p2p, run, member_list):
        members = tuple(member_list)
        # PEERD_BENCH_CONFIG='{"chunk_numel": 262144}' overrides any averaging option, for A/B runs
        overrides = json.loads(os.environ.get("PEERD_BENCH_CONFIG") or "{}")
        if os.environ.get("PEERD_BENCH_CHUNK"):
            overrides["chunk_numel"] = int(os.environ["PEERD_BENCH_CHUNK"])
        if aggregation is not None:
            overrides["aggregation"] = aggregation
        config = AveragingConfig(**{"round_timeout": 120.0, "join_timeout": 30.0, **overrides})
        guard = StreamGuard(p2p, Membership(secret), StreamLimits())
        if verified:
            from peerd.swarm.signing import RecordSigner

            reducer = AllReducer(guard, config, RecordSigner(identity.read_bytes(), Membership(secret)))
        else:
            reducer = AllReducer(guard, config)
        run(reducer.start())
        ctx.barrier("peerd-handlers")
        sent = 0
        out = torch.empty_like(ctx.input)  # reused like gloo's in-place buffer: a round allocates nothing big
        for rep in ctx.repetitions():
            with ctx.timed(rep):
                result, report = run(reducer.all_reduce(Group(f"bench-{rep}", members), ctx.input, 1.0, out=out))
            if report.excluded:
                ctx.fail(rep, f"excluded: {report.excluded}")
            # the verification's bytes too (a baseline revision may predate them)
            sent = report.bytes_sent + getattr(report, "check_bytes_sent", 0)
            ctx.check(rep, result)
        ctx.extra["payload_bytes_sent"] = sent


def tcp_worker(ctx: WorkerCtx) -> None:
    """Reference, not an all-reduce: plain TCP sockets move peerd's payload in peerd's traffic pattern.

    One persistent connection per pair of peers carries both directions (as p2pd's one libp2p connection per
    pair does); in each repetition every peer sends peerd's payload/peer, split evenly over its n-1 partners,
    to all of them at once and reads as much from each, with no codec, no framing, no encryption and no data
    dependency. Its time is what TCP itself needs for those bytes on this network: a floor for peerd's row.
    """
    import socket
    import threading

    per_pair = int(_peerd_payload(ctx.numel, ctx.n) / (ctx.n - 1))
    listener = socket.create_server((ctx.addr, 0))
    ctx.publish(f"tcp-port-{ctx.rank}", listener.getsockname()[1])
    conns: dict[int, socket.socket] = {}
    for peer in range(ctx.rank + 1, ctx.n):  # the lower rank dials
        conn = socket.create_connection((ctx.addrs[peer], ctx.lookup(f"tcp-port-{peer}")), timeout=60)
        conn.sendall(ctx.rank.to_bytes(4, "little"))
        conns[peer] = conn
    while len(conns) < ctx.n - 1:
        conn, _ = listener.accept()
        conns[int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")] = conn
    for conn in conns.values():
        conn.settimeout(120)
    block = bytes(1 << 16)

    def send(conn: socket.socket) -> None:
        for start in range(0, per_pair, len(block)):
            conn.sendall(block[: min(len(block), per_pair - start)])

    def receive(conn: socket.socket) -> None:
        buf, left = bytearray(1 << 20), per_pair
        while left:
            got = conn.recv_into(buf, min(len(buf), left))
            if not got:
                raise ConnectionError("peer closed the connection mid-repetition")
            left -= got

    def guarded(fn: Callable[[socket.socket], None], conn: socket.socket, errors: list[str]) -> None:
        try:
            fn(conn)
        except OSError as e:
            errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")

    try:
        for rep in ctx.repetitions():
            errors: list[str] = []
            with ctx.timed(rep):
                threads = [threading.Thread(target=guarded, args=(fn, conn, errors)) for conn in conns.values()
                           for fn in (send, receive)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            if errors:
                ctx.fail(rep, errors[0])
            ctx.check(rep, ctx.expected)  # nothing is averaged; records the CPU time only
    finally:
        for conn in conns.values():
            conn.close()
        listener.close()


def p2pd_worker(ctx: WorkerCtx) -> None:
    """Reference, not an all-reduce: the tcp row's bytes and pattern, but through p2pd streams as peerd's are.

    Same payload split as tcp_worker (peerd's payload/peer evenly over the n-1 partners, all at once, no codec
    and no data dependency), carried by hivemind's P2P binary streams: p2pd's one libp2p connection per pair
    (TCP + TLS/noise + yamux) and its Unix-socket hop to this process. Two streams per ordered pair, as peerd
    has (a member's stream to each reducer and each reducer's stream back). A peer is done when it has read
    every byte addressed to it and each receiver confirmed its bytes (one byte back per stream: a stream closed
    right after its last write lost its last 32 KiB through p2pd in 2 of 10 repetitions). The gap between this row
    and tcp is what the transport costs; the gap between peerd and this row is what peerd's algorithm costs.
    """
    import asyncio
    import itertools

    from hivemind.p2p import PeerID

    from peerd.wire.frames import wait_for_close

    streams_per_pair = 2
    per_stream = int(_peerd_payload(ctx.numel, ctx.n) / (ctx.n - 1) / streams_per_pair)
    expected_streams = (ctx.n - 1) * streams_per_pair
    received: list[int] = []  # sizes of finished incoming streams, over all repetitions
    progress = asyncio.Condition()  # binds to the p2p loop on first use

    async def handler(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while chunk := await reader.read(1 << 20):
            got += len(chunk)
            if got >= per_stream:
                break
        writer.write(b"k")  # the sender closes only after this: closing with bytes in flight can lose the tail
        await writer.drain()
        await wait_for_close(reader)  # ... and so does this side: over QUIC, closing first loses the "k"
        writer.close()
        async with progress:
            received.append(got)
            progress.notify_all()

    async def send(member: str) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(member), "bench.bulk")
        block = bytes(1 << 16)
        for start in range(0, per_stream, len(block)):
            writer.write(block[: min(len(block), per_stream - start)])
            await writer.drain()
        await reader.readexactly(1)
        writer.close()

    async def one_rep(members: list[str], done_before: int) -> None:
        await asyncio.gather(*(send(m) for i, m in enumerate(members) if i != ctx.rank
                               for _ in range(streams_per_pair)))
        async with progress:
            await progress.wait_for(lambda: len(received) >= done_before + expected_streams)

    with _p2p_on_loop(ctx, "bulk") as (p2p, run, members):
        run(p2p.add_binary_stream_handler("bench.bulk", handler))
        ctx.barrier("bulk-handlers")
        # counted, not read from len(received) after the barrier: a partner's streams may already be in by then
        for done_before, rep in zip(itertools.count(0, expected_streams), ctx.repetitions(), strict=False):
            with ctx.timed(rep):
                run(asyncio.wait_for(one_rep(members, done_before), 120))
            short = [size for size in received[done_before:] if size != per_stream]
            if short:
                ctx.fail(rep, f"{len(short)} incoming streams ended early ({short[0]} of {per_stream} bytes)")
            ctx.check(rep, ctx.expected)  # nothing is averaged; records the CPU time only


def _peerd_payload(numel: int, n: int) -> float:
    """8-bit codes + a bf16 scale per 128 elements (the default block), for 2*(n-1)/n of the tensor per peer."""
    return 2 * (n - 1) / n * numel * (1 + 2 / 128)


def _ring_like(numel: int, n: int) -> float:
    """Ring (gloo) and butterfly (hivemind) all-reduce both send 2*(n-1)/n of the fp32 tensor per peer."""
    return 2 * (n - 1) / n * numel * 4


BACKENDS: dict[str, Backend] = {
    "gloo": Backend(gloo_worker, tolerance=1e-4, payload_bytes=_ring_like),
    # 8-bit: an element is off by at most half a quantization step of its block, twice (contribution, average)
    "peerd": Backend(peerd_worker, tolerance=0.1, payload_bytes=_peerd_payload),
    # the same with a swarm secret: the membership handshake's cost on every stream of a round
    "peerd_secret": Backend(functools.partial(peerd_worker, secret=bytes(range(32))), tolerance=0.1,
                            payload_bytes=_peerd_payload),
    # the streaming weighted mean instead of the robust default: peerd / peerd_mean = what robustness costs
    "peerd_mean": Backend(functools.partial(peerd_worker, aggregation="mean"), tolerance=0.1,
                          payload_bytes=_peerd_payload),
    "hivemind": Backend(hivemind_worker, tolerance=1e-4, payload_bytes=_ring_like,
                        metrics=("allreduce", "step", "matchmaking")),
    "p2pd": Backend(p2pd_worker, tolerance=0.0, payload_bytes=_peerd_payload, reference=True),
    "tcp": Backend(tcp_worker, tolerance=0.0, payload_bytes=_peerd_payload, reference=True),
}


# ---------------------------------------------------------------------------------------------------------------


def _die_with_harness() -> None:
    """SIGKILL our whole process group (us, hivemind's DHT/averager children, p2pd) once the harness is gone.

    The harness starts every worker in its own session, so a killed harness would otherwise leave them running.
    """
    import select
    import signal
    import threading

    if os.getpgrp() != os.getpid():
        return  # not started by the harness in our own group: never kill a group we do not lead
    parent = int(os.environ.get("BENCH_HARNESS_PID") or os.getppid())
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:  # the harness died while we were starting up
        os.killpg(0, signal.SIGKILL)
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)

    def watch() -> None:
        select.select([fd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="die-with-harness").start()


def main() -> None:
    _die_with_harness()
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--addrs", required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rdv", required=True)
    p.add_argument("--iface", default=None)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--transport", choices=("tcp", "quic"), default="tcp")
    a = p.parse_args()

    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.n))
    result: dict = {"backend": a.backend, "rank": a.rank, "error": None}
    ctx = None
    try:
        ctx = WorkerCtx(a.backend, a.rank, a.n, a.addrs.split(","), a.numel, a.reps, a.warmup, Path(a.rdv),
                        iface=a.iface, port=a.port, transport=a.transport)
        BACKENDS[a.backend.split("@")[0]].worker(ctx)
    except BaseException as e:  # noqa: BLE001 - always report
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)
    if ctx is not None:
        result["records"] = ctx.records
        result["extra"] = ctx.extra
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    # hivemind leaves non-daemon helpers around on some error paths; the harness waits for our exit
    os._exit(0)


if __name__ == "__main__":
    main()
