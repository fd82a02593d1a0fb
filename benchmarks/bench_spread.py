"""The samples' spread check of verified reductions (peerd/averaging/verify/checks.py ``_check_spread``), both
sides of it.

- **Honest rows.** Gradients of a small GPT-2 (``transformers``, built from a config: nothing downloaded) on
  different batches of Zipf-distributed tokens, one per member, coded as 8-bit blocks and as top-k, cut into
  averaging chunks. For every pair of members, chunk and round seed: the largest ratio, over the sample ranks,
  of the sampled squared difference to what the check allows. An alarm is a ratio over 1.
- **A reducer lying about its own row** (tests/unit/verified_chunks.py ``Span.misstate_own_row``): -1000x the
  honest average on a fraction of the elements, its own row sketched close and sampled far off; in how many
  rounds (seeds) the check catches it.

Run: .venv/bin/python benchmarks/bench_spread.py [--seeds 1000] [--trials 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from peerd.averaging.verify.checks import Inconsistent, check_chunk, spread_bounds
from peerd.averaging.verify.payloads import view
from peerd.averaging.verify.randomness import SAMPLES, RoundRandomness
from peerd.config import CodecConfig
from peerd.tables import format_table
from peerd.wire import codec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.unit.verified_chunks

VOCAB = 4096


def gradients(members: int, seq: int = 64, batch: int = 8) -> torch.Tensor:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1
    rows = []
    for member in range(members):
        tokens = torch.multinomial(zipf, batch * seq, replacement=True,
                                   generator=torch.Generator().manual_seed(member)).reshape(batch, seq)
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    return torch.stack(rows)


def honest_ratios(rows: torch.Tensor, scheme: str, chunk_numel: int, seeds: int) -> torch.Tensor:
    config = CodecConfig(scheme=scheme, min_compress_numel=0)  # type: ignore[arg-type]
    bounds = spread_bounds(SAMPLES)
    ratios = []
    for index, start in enumerate(range(0, rows.shape[1], chunk_numel)):
        chunk = rows[:, start : start + chunk_numel].contiguous()
        decoded = torch.stack([codec.decode(bytes(codec.encode(row, config)), peer_id="bench",
                                            expected_shape=(row.numel(),)) for row in chunk]).double()
        length = decoded.shape[1]
        distances = ((decoded[:, None, :] - decoded[None, :, :]) ** 2).sum(-1)
        for seed in range(seeds):
            values = decoded[:, RoundRandomness(seed.to_bytes(32, "big"), chunk_numel).offsets(0, index, length)]
            ordered = length * ((values[:, None, :] - values[None, :, :]) ** 2).sort(-1, descending=True).values
            for a in range(len(decoded)):
                for b in range(a + 1, len(decoded)):
                    if float(distances[a, b]) > 0:
                        ratios.append(float((ordered[a, b] / (bounds * distances[a, b])).max()))
    return torch.tensor(ratios)


def caught(fraction: float, trials: int) -> int:
    from tests.unit.verified_chunks import Span, honest_rows

    found = 0
    for trial in range(trials):
        span = Span(honest_rows(4, seed=trial), "centered_clip", seed=bytes([trial + 1]) * 32)
        lie_on = torch.rand(span.rows.shape[1], generator=torch.Generator().manual_seed(1000 + trial)) < fraction
        samples = span.misstate_own_row(lie_on)
        try:
            check_chunk(span.statement(), 0, samples, span.out, view(span.out_payload), span.randomness,
                        span.config)
        except Inconsistent:
            found += 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--chunk-numel", type=int, default=2**19)
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}")
    rows = gradients(args.members)
    table = []
    for scheme in ("blockwise8", "topk"):
        ratios = honest_ratios(rows, scheme, args.chunk_numel, args.seeds)
        table.append([scheme, len(ratios), f"{float(ratios.max()):.4f}", f"{float(ratios.mean()):.4f}",
                      int((ratios > 1).sum())])
    print(f"honest gradients: {rows.shape[1]:,} elements, {args.members} members, chunks of {args.chunk_numel:,}")
    print(format_table(["codec", "pairs x chunks x seeds", "largest ratio", "mean", "alarms"], table))
    lies = [[f"{fraction:.0%}", f"{caught(fraction, args.trials)} of {args.trials}"]
            for fraction in (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)]
    print("a reducer sampling its own row far off, -1000x on a fraction of the elements:")
    print(format_table(["elements lied on", "rounds it is caught in"], lies))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
