"""The hf task's cost: a peer training the tiny Llama of configs/hf-tiny.yaml against a plain transformers + torch
loop on the same model, data and batches, in the same run; and 3 diloco peers against one lone peer.

1. **Overhead.** A lone `peerd start` (sync mode, nobody to average with) trains ``--batches`` micro-batches; its
   tokens per second are the samples it trained times seq_len over the wall time from its first micro-batch to
   its last (the report's ``wall_seconds``). The plain loop is a separate process: the same model built from the
   same config and seed, AdamW, and the very batches of the peer's shard, tokenized before the clock starts (so
   the loop pays nothing for its data: the comparison is strict against peerd). Both use ``--threads`` torch
   threads and flush subnormal floats to zero (peerd/threads.py). Target: the peer within 5% of the loop. Peak
   RSS (the kernel's high-water mark) of the peer's daemon process against the loop's process; the peer's p2pd
   and DHT child are listed apart.
2. **Sharing the cores.** 3 peers in diloco mode on loopback train together for ``--batches`` micro-batches
   each; their tokens per second summed, against the lone peer's. Target: at least 90% (the cores are the
   limit; averaging must not take from them).

Runs alternate (loop, lone peer, 3 peers) ``--repeats`` times; the table has each run and the medians.

3. **LoRA's bytes** (``--lora``): the same model saved as a pretrained directory, fine-tuned by 3 peers in sync
   mode for ``--lora-steps`` steps, once with LoRA adapters (rank 8 on q_proj and v_proj) and once in full:
   payload bytes each peer sent per averaged round, and the ratio.

Run: .venv/bin/python benchmarks/bench_hf.py [--batches 240] [--threads 2] [--repeats 2] [--lora]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from peerd.tables import format_table

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "hf-tiny.yaml"
MIB = 2**20


def plain_loop(batches: int, threads: int) -> dict[str, float]:
    """Runs in its own process (``--plain-loop``): the baseline, timed from the first batch to the last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from peerd.config import load_config
    from peerd.tasks import build_task, derive_seed, seeded_module

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as peerd's compute thread does (peerd/threads.py)
    task_config = load_config(CONFIG).training.task
    task = build_task(task_config, 0)  # for its data only: the model below is built the plain way
    stream = task.train_batches()
    data = [next(stream) for _ in range(batches)]
    settings = dict(task_config.options["config"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = seeded_module(derive_seed(task_config.seed, "model"),
                          lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    started = time.perf_counter()
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    tokens = batches * data[0].numel()
    return {"tokens_per_second": tokens / seconds, "peak_rss_mib": _peak_rss(os.getpid()), "loss": float(loss.detach())}


def _peak_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB
    return float("nan")


def run_loop(batches: int, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--plain-loop", "--batches", str(batches), "--threads",
                          str(threads)], capture_output=True, text=True, timeout=1800, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def peer_args(batches_per_step: int, steps: int, mode: str) -> list[str]:
    args = ["-o", f"training.max_steps={steps}", "-o", "training.validation_every=1000000",
            "-o", "training.state_averaging_every=0", "-o", "training.sync_state_on_join=false",
            "-o", "training.optimizer=adamw"]
    if mode == "diloco":
        return [*args, "-o", "training.mode=diloco", "-o", f"training.diloco.inner_steps={batches_per_step}"]
    return [*args, "-o", "training.mode=sync", "-o", f"training.target_batch_size={8 * batches_per_step}"]


def tokens_per_second(peer: PeerProcess, seq_len: int) -> float:
    report = peer.status()["training"]
    return float(report["samples_trained"] * seq_len / report["wall_seconds"])


def run_peers(count: int, batches: int, threads: int, log_dir: Path) -> dict[str, Any]:
    """``count`` peers (1: sync mode alone; more: diloco), each training ``batches`` micro-batches."""
    log_dir.mkdir(parents=True, exist_ok=True)
    per_step = 20
    mode = "sync" if count == 1 else "diloco"
    args = [*peer_args(per_step, max(1, batches // per_step), mode), "-o", f"training.wait_for_peers={count}"]
    with LocalSwarm(CONFIG, log_dir=log_dir, extra_args=args, env={"OMP_NUM_THREADS": str(threads)}) as swarm:
        swarm.add_peer(timeout=180)
        for _ in range(count - 1):
            swarm.spawn_peer()
        for peer in swarm.peers:
            peer.wait_ready(180)
        wait_for(lambda: all(p.status()["training"]["state"] == "idle" for p in swarm.peers), 1800,
                 "every peer to finish", 1.0)
        rates = [tokens_per_second(p, 128) for p in swarm.peers]
        daemon = swarm.peers[0]
        result = {"tokens_per_second": sum(rates), "each": rates, "peak_rss_mib": _peak_rss(daemon.proc.pid),
                  "tree": {psutil.Process(pid).name(): psutil.Process(pid).memory_info().rss / MIB
                           for pid in daemon.alive_tree() if pid != daemon.proc.pid}}
        swarm.stop()
    return result


def lora_bytes(steps: int, log_dir: Path) -> list[list[str]]:
    """Bytes per round of 3 peers fine-tuning the demo's model, with LoRA and in full."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from peerd.config import load_config

    options = load_config(CONFIG).training.task.options
    settings = dict(options["config"])
    model_dir = log_dir / "pretrained"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(REPO / options["tokenizer"]).save_pretrained(model_dir)
    rows = []
    for name, lora in (("LoRA r=8 (q_proj, v_proj)", "{r: 8}"), ("full fine-tuning", "null")):
        args = ["-o", f"training.task.options.model={model_dir}", "-o", "training.task.options.config=null",
                "-o", "training.task.options.tokenizer=null", "-o", f"training.task.options.lora={lora}",
                "-o", "training.mode=sync", "-o", "training.target_batch_size=48", "-o", f"training.max_steps={steps}",
                "-o", "training.state_averaging_every=0", "-o", "training.wait_for_peers=3"]
        with LocalSwarm(CONFIG, log_dir=log_dir, extra_args=args) as swarm:
            swarm.add_peer(timeout=180)
            swarm.spawn_peer()
            swarm.spawn_peer()
            for peer in swarm.peers:
                peer.wait_ready(180)
            wait_for(lambda: all(p.status()["training"]["state"] == "idle" for p in swarm.peers), 1800,
                     "every peer to finish", 1.0)
            reports = [p.status()["training"] for p in swarm.peers]
            swarm.stop()
        sent = sum(r["bytes_sent"] for r in reports) / max(1, sum(r["rounds_ok"] for r in reports))
        rows.append([name, f"{reports[0]['parameters']:,}", f"{reports[0]['model_parameters']:,}",
                     str(sum(r["rounds_ok"] for r in reports)), f"{sent / 1024:,.1f}"])
    full, adapters = float(rows[1][-1].replace(",", "")), float(rows[0][-1].replace(",", ""))
    rows.append(["ratio", "", "", "", f"{full / adapters:.0f}x fewer bytes with LoRA"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=240, help="Micro-batches of 8 x 128 tokens per run.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the loop and the lone peer.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="Measure LoRA's bytes per round against full.")
    parser.add_argument("--lora-steps", type=int, default=10)
    parser.add_argument("--plain-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_loop:
        print(json.dumps(plain_loop(args.batches, args.threads)))
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} cores, load {os.getloadavg()}")
    if args.lora:
        with tempfile.TemporaryDirectory(prefix="peerd-bench-hf-") as tmp:
            print(format_table(["run", "trainable", "parameters", "rounds (3 peers)", "KiB sent per peer per round"],
                               lora_bytes(args.lora_steps, Path(tmp))))
        return
    rows, loops, lones, threes = [], [], [], []
    for repeat in range(args.repeats):
        loop = run_loop(args.batches, args.threads)
        logs = Path(tempfile.mkdtemp(prefix="peerd-bench-hf-"))  # kept: the peers' logs, if one fails
        print(f"run {repeat + 1}: peer logs in {logs}", flush=True)
        lone = run_peers(1, args.batches, args.threads, logs / "lone")
        three = run_peers(3, args.batches, 1, logs / "three")  # side by side, one thread each
        loops.append(loop["tokens_per_second"])
        lones.append(lone["tokens_per_second"])
        threes.append(three["tokens_per_second"])
        rows.append([str(repeat + 1), f"{loop['tokens_per_second']:.0f}", f"{lone['tokens_per_second']:.0f}",
                     f"{lone['tokens_per_second'] / loop['tokens_per_second']:.3f}",
                     f"{three['tokens_per_second']:.0f} ({', '.join(f'{r:.0f}' for r in three['each'])})",
                     f"{three['tokens_per_second'] / lone['tokens_per_second']:.3f}",
                     f"{loop['peak_rss_mib']:.0f}", f"{lone['peak_rss_mib']:.0f}",
                     ", ".join(f"{name} {rss:.0f}" for name, rss in lone["tree"].items()),
                     f"{os.getloadavg()[0]:.1f}"])
    print(format_table(["run", "loop tok/s", "peer tok/s", "peer/loop", "3 diloco tok/s (each)", "3/lone",
                        "loop peak RSS", "peer peak RSS", "peer's children RSS", "load"], rows))
    loop, lone, three = statistics.median(loops), statistics.median(lones), statistics.median(threes)
    print(f"medians: loop {loop:.0f}, lone peer {lone:.0f} ({lone / loop:.3f} of the loop; target >= 0.95), "
          f"3 diloco peers {three:.0f} ({three / lone:.3f} of the lone peer; target >= 0.90) tokens/s")


if __name__ == "__main__":
    main()
