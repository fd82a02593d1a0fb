"""Sizing the ``lm`` task for a slow link: forward+backward time of one micro-batch vs the all-reduce of the model.

For each candidate (d_model, n_layers, d_ff, batch_size, seq_len) prints the parameter count, the median
seconds of one micro-batch's forward+backward and of one Adam step on one thread (a peer runs with
OMP_NUM_THREADS=1; 4 peers on this 2-core machine get about half a core each, so double it there), and the
time an 8-bit all-reduce of the model takes among ``--peers`` peers on a ``--rate`` Mbit/s link: each peer
sends and receives 2(n-1)/n of the model at 1.016 bytes per element, at line rate and at the 77% of line peerd
reached with 4 peers over TCP at 100 Mbit/s (docs/benchmarks.md, "All-reduce"). ``compute/comm`` below 1 means sync mode
is communication-bound. configs/lm-wan.yaml was chosen with it.

Run: .venv/bin/python benchmarks/lm_sizes.py [--peers 4] [--rate 100] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import datetime

import torch
import torch.nn.functional as F

from peerd.tables import format_table
from peerd.tasks.lm import VOCAB, ByteTransformer

CODEC_BYTES_PER_ELEMENT = 1.016
TCP_EFFICIENCY = 0.77  # peerd's 8-bit all-reduce of 4 peers at 100 Mbit/s over TCP (docs/benchmarks.md, "All-reduce")
# (d_model, n_layers, d_ff, batch_size, seq_len)
CANDIDATES = [
    (128, 2, 512, 16, 128),  # configs/lm.yaml, for reference
    (384, 6, 1536, 8, 128),
    (384, 8, 1536, 8, 128),
    (512, 6, 2048, 4, 128),
    (512, 6, 2048, 8, 128),
    (512, 6, 2048, 16, 128),
    (512, 8, 2048, 8, 128),
    (768, 6, 3072, 4, 128),
]


def time_micro_batch(d_model: int, n_layers: int, d_ff: int, batch: int, seq: int, reps: int) -> tuple[int, float, float]:
    torch.manual_seed(0)
    model = ByteTransformer(d_model, n_layers, d_model // 64 if d_model >= 256 else 4, d_ff, seq)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1))
    fb, step = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended = time.perf_counter()
        if rep:
            fb.append(middle - started)
            step.append(ended - middle)
    return params, statistics.median(fb), statistics.median(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.peers
    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"1 thread; load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = []
    for d_model, n_layers, d_ff, batch, seq in CANDIDATES:
        params, fb, step = time_micro_batch(d_model, n_layers, d_ff, batch, seq, args.reps)
        per_direction = 2 * (n - 1) / n * params * CODEC_BYTES_PER_ELEMENT
        line = per_direction * 8 / (args.rate * 1e6)
        rows.append([f"d{d_model} L{n_layers} ff{d_ff}", f"{batch}x{seq}", f"{params / 1e6:.1f}M", f"{fb:.3f}",
                     f"{step:.3f}", f"{per_direction / 1e6:.1f} MB", f"{line:.2f}", f"{line / TCP_EFFICIENCY:.2f}",
                     f"{2 * fb / (line / TCP_EFFICIENCY):.2f}"])
        print("  ", " ".join(rows[-1]), flush=True)
    print(f"\nload average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(format_table(["model", "micro-batch", "params", "fwd+bwd s (1 thread)", "adam step s",
                        f"sent/peer/round (n={n})", f"all-reduce s at {args.rate:g} Mbit", "at 77% of line",
                        f"compute/comm ({n} peers on 2 cores)"], rows))


if __name__ == "__main__":
    main()
