"""Aggregation rules on one reducer chunk: robustness to a member sending -1000x its gradient while claiming 10x
the samples, the bias they add without attackers, and their CPU cost per chunk next to the mean.

Honest members hold ``g + noise_i`` with ``||noise_i|| = spread * ||g||`` (a shard's gradient scatters around
the group's; ``--spreads`` sweeps how far). Errors are ``||aggregate - honest mean|| / ||honest mean||``, medians
over ``--trials``. Rules: peerd's ``mean`` (claimed weights, as the streaming path), ``centered_clip`` and
``trimmed_mean`` with capped weights (peerd/averaging/aggregation.py), and norm clipping to the members'
median norm (a common defence, here to show why peerd does not use it: it bounds a contribution's size, not
its direction).

Run: .venv/bin/python benchmarks/bench_aggregation.py [--members 4] [--numel 524288] [--trials 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from peerd.averaging.aggregation import cap_weights, combine, weighted_mean
from peerd.config import AveragingConfig
from peerd.tables import format_table

Rule = Callable[[torch.Tensor, list[float], torch.Tensor], object]


def norm_clip(rows: torch.Tensor, claims: list[float], out: torch.Tensor, max_weight_ratio: float) -> object:
    norms = torch.linalg.vector_norm(rows, dim=1)
    scales = torch.clamp(float(torch.median(norms)) / norms.clamp_min(1e-30), max=1.0)
    return weighted_mean(rows * scales[:, None], cap_weights(claims, max_weight_ratio), out)


def rules(config: AveragingConfig) -> dict[str, Rule]:
    def peerd_rule(name: str) -> Rule:
        def apply(rows: torch.Tensor, claims: list[float], out: torch.Tensor) -> object:
            ratio = float("inf") if name == "mean" else config.max_weight_ratio
            return combine(name, rows, claims, out, ratio, config.clip_radius, config.clip_iterations)
        return apply

    return {
        "mean (claimed weights)": peerd_rule("mean"),
        "norm clip to median norm": lambda rows, claims, out: norm_clip(rows, claims, out, config.max_weight_ratio),
        "trimmed_mean": peerd_rule("trimmed_mean"),
        "centered_clip": peerd_rule("centered_clip"),
    }


def members(n: int, numel: int, spread: float, attacked: bool, seed: int) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=generator)
    noise = torch.randn(n, numel, generator=generator)
    noise *= spread * g.norm() / torch.linalg.vector_norm(noise, dim=1, keepdim=True)
    rows = g + noise
    honest = rows[: n - 1].mean(0) if attacked else rows.mean(0)
    claims = [32.0] * n
    if attacked:
        rows[n - 1] *= -1000.0
        claims[n - 1] *= 10
    return rows, claims, honest


def error(rule: Rule, n: int, numel: int, spread: float, attacked: bool, trials: int) -> float:
    errors = []
    for trial in range(trials):
        rows, claims, honest = members(n, numel, spread, attacked, trial)
        out = torch.empty(numel)
        rule(rows, claims, out)
        errors.append(float((out - honest).norm() / honest.norm()))
    return statistics.median(errors)


def cost_ms(rule: Rule, n: int, numel: int, trials: int) -> float:
    rows, claims, _ = members(n, numel, 1.0, False, 0)
    out = torch.empty(numel)
    rule(rows, claims, out)  # warm-up
    times = []
    for _ in range(max(5, trials)):
        started = time.perf_counter()
        rule(rows, claims, out)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--numel", type=int, default=AveragingConfig().chunk_numel)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.5, 1.0, 3.0])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a peer runs (OMP_NUM_THREADS=1)
    config = AveragingConfig()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.members} members, chunks of "
          f"{args.numel} elements; clip_radius {config.clip_radius}, clip_iterations {config.clip_iterations}, "
          f"max_weight_ratio {config.max_weight_ratio}")
    rows = []
    for name, rule in rules(config).items():
        row = [name]
        for spread in args.spreads:
            row.append(f"{error(rule, args.members, args.numel, spread, True, args.trials):.3g}")
        for spread in args.spreads:
            row.append(f"{error(rule, args.members, args.numel, spread, False, args.trials):.3g}")
        row.append(f"{cost_ms(rule, args.members, args.numel, args.trials):.2f}")
        rows.append(row)
    headers = (["rule"] + [f"attacked, spread {s:g}" for s in args.spreads]
               + [f"no attack, spread {s:g}" for s in args.spreads] + ["ms per chunk"])
    print("relative error of the aggregate vs the honest members' mean (lower is better)")
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
