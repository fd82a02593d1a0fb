"""A member gone bad, for tests only: `python -m tests.integration.framer start ...` is `peerd start ...` that
contributes honestly but states its rows as -1000 times what it sealed (its samples, envelopes, block norms and
sketches), so the honest reducers' averages look wrong to the others: an attempt to get honest members excluded."""

from __future__ import annotations

from typing import Any

from peerd.averaging.verify import round as verification
from peerd.averaging.verify.samples import OwnRow
from peerd.cli import main

SCALE = -1000.0

_honest_rows = verification.row_samples


def _framing_build(key: Any, round_id: str, randomness: Any, rows: dict[int, OwnRow], *args: Any) -> Any:
    lies = {span: OwnRow(own.row * SCALE, own.chunks, [bound * abs(SCALE) for bound in own.envelopes],
                         [norms * abs(SCALE) for norms in own.norms])
            for span, own in rows.items()}
    return _honest_rows(key, round_id, randomness, lies, *args)


verification.row_samples = _framing_build  # type: ignore[assignment]

if __name__ == "__main__":
    main()
