"""An honest member that checks nothing, for tests only: `python -m tests.integration.unverified start ...` is
`peerd start ...` that applies every average it gets back unchecked: what a lying reducer does when nobody
checks."""

from __future__ import annotations

from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.verdict import Verdict
from peerd.cli import main


async def _believe(self: RoundVerification, span: int) -> Verdict:
    self.verdicts[span] = Verdict(True)
    return self.verdicts[span]


RoundVerification.verdict = _believe  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
