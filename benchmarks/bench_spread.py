"""The checks of verified reductions that hold a reducer to its own row: the samples' spread
(peerd/averaging/verify/sketches.py ``spread_too_wide``) and the rows' block norms (peerd/averaging/verify/energy.py),
both sides of each.

- **Honest rows.** Gradients of a small GPT-2 (``transformers``, built from a config: nothing downloaded) on
  different batches of Zipf-distributed tokens, one per member, coded as 8-bit blocks and as top-k, cut into
  averaging chunks. For every pair of members, chunk and round seed: the largest ratio, over the sample ranks,
  of the sampled squared difference to what the check allows. For every pair and chunk: the block norms' lower
  bound on the pair's squared distance over that distance; for every chunk, the largest ratio over the blocks of
  the members' mean's norm to what its rows' norms allow. An alarm is a ratio over 1.
- **A reducer lying about its own row** (tests/unit/verified_chunks.py ``Span.misstate_own_row``): -1000x the
  honest average on a fraction of the elements, its own row sketched close and sampled (and block-normed) far
  off; in how many rounds (seeds) the checks catch it, with the spread check alone and with every check.

Run: .venv/bin/python benchmarks/bench_spread.py [--seeds 1000] [--trials 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from peerd.averaging.verify import checks
from peerd.averaging.verify.checks import Inconsistent, check_chunk
from peerd.averaging.verify.energy import DISTANCE_SLACK, distance_floor
from peerd.averaging.verify.payloads import block_norms, error_norms, view
from peerd.averaging.verify.randomness import SAMPLES, RoundRandomness
from peerd.averaging.verify.sketches import spread_bounds
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


def honest_energy(rows: torch.Tensor, scheme: str, chunk_numel: int) -> tuple[float, float]:
    """The largest ratios, over chunks, pairs and blocks, of the block norms' bound on a distance to the distance
    (with the check's float slack) and of the members' mean's block norm to what the rows' norms allow."""
    config = CodecConfig(scheme=scheme, min_compress_numel=0)  # type: ignore[arg-type]
    distance, average = 0.0, 0.0
    for start in range(0, rows.shape[1], chunk_numel):
        chunk = rows[:, start : start + chunk_numel].contiguous()
        decoded = torch.stack([codec.decode(bytes(codec.encode(row, config)), peer_id="bench",
                                            expected_shape=(row.numel(),)) for row in chunk])
        norms = torch.stack([block_norms(row, config.block_size) for row in decoded]).float().double()
        exact = decoded.double()
        squared = ((exact[:, None, :] - exact[None, :, :]) ** 2).sum(-1)
        lower = distance_floor(norms)
        off = ~torch.eye(len(decoded), dtype=torch.bool)
        distance = max(distance, float((lower[off] / (squared[off] * DISTANCE_SLACK)).max()))
        payload = bytes(codec.encode(decoded.mean(0), CodecConfig(min_compress_numel=0)))
        out = codec.decode(payload, peer_id="bench", expected_shape=(decoded.shape[1],))
        allowed = norms.mean(0) + error_norms(view(payload), out, config.block_size)
        average = max(average, float((block_norms(out, config.block_size) / allowed).max()))
    return distance, average


def caught(fraction: float, trials: int, block_norms_checked: bool) -> int:
    from tests.unit.verified_chunks import Span, honest_rows

    found = 0
    for trial in range(trials):
        span = Span(honest_rows(4, seed=trial), "centered_clip", seed=bytes([trial + 1]) * 32)
        lie_on = torch.rand(span.rows.shape[1], generator=torch.Generator().manual_seed(1000 + trial)) < fraction
        samples = span.misstate_own_row(lie_on)
        rows_too_far, average_too_large = checks.rows_too_far, checks.average_too_large
        if not block_norms_checked:
            checks.rows_too_far, checks.average_too_large = lambda *args: False, lambda *args: None
        try:
            check_chunk(span.statement(), 0, samples, span.out, view(span.out_payload), span.randomness,
                        span.config)
        except Inconsistent:
            found += 1
        finally:
            checks.rows_too_far, checks.average_too_large = rows_too_far, average_too_large
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
    energy = []
    for scheme in ("blockwise8", "topk"):
        ratios = honest_ratios(rows, scheme, args.chunk_numel, args.seeds)
        table.append([scheme, len(ratios), f"{float(ratios.max()):.4f}", f"{float(ratios.mean()):.4f}",
                      int((ratios > 1).sum())])
        energy.append([scheme, *(f"{ratio:.4f}" for ratio in honest_energy(rows, scheme, args.chunk_numel))])
    print(f"honest gradients: {rows.shape[1]:,} elements, {args.members} members, chunks of {args.chunk_numel:,}")
    print("the samples' spread:")
    print(format_table(["codec", "pairs x chunks x seeds", "largest ratio", "mean", "alarms"], table))
    print("the block norms (largest ratio to what the check allows):")
    print(format_table(["codec", "distances", "the mean's norms"], energy))
    lies = [[f"{fraction:.2%}", *(f"{caught(fraction, args.trials, on)} of {args.trials}" for on in (False, True))]
            for fraction in (1.0, 0.1, 0.05, 0.02, 0.01, 0.002, 0.0005)]
    print("a reducer sampling its own row far off, -1000x on a fraction of the elements:")
    print(format_table(["elements lied on", "caught: spread check alone", "every check"], lies))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
