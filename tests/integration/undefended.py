"""peerd with some defences switched off, for tests and benchmarks only: what the attacks would do without them.

    python -m tests.integration.undefended start --undefended NAME[,NAME...] <peerd start arguments>

is ``peerd start`` with each named defence replaced by what peerd did without it (DEFENCES says what each
one turns off). It runs the honest code everywhere else: a test runs the same scenario against ``peerd`` and
against this, and asserts that the damage shows only here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes

from peerd.cli import main
from peerd.swarm import sealing, signing
from peerd.wire.guard import StreamGuard


def _any_key() -> None:
    """Verify signatures by any RSA key, whatever its exponent and size."""
    signing.key_problem = lambda key: None


def _verify_first() -> None:
    """Verify the signature before the member tag (a stranger's record costs an RSA verification)."""
    honest = signing.RecordVerifier._check

    def check(self: signing.RecordVerifier, message: bytes, public_key: bytes, signature: bytes, tag: bytes,
              signer: str) -> Any:
        key = signing._public_key(public_key)
        if key is not None and signing.key_problem(key) is None:
            try:
                key.verify(signature, message, signing._PSS, hashes.SHA256())
            except InvalidSignature:
                return "bad_signature", f"signature by {signer} does not verify"
        return honest(self, message, public_key, signature, tag, signer)

    signing.RecordVerifier._check = check  # type: ignore[method-assign]


def _no_expiration_cap() -> None:
    """Believe any expiration a record is signed with."""
    signing.RecordLifetimes.cap = lambda self, key_id_bytes: math.inf  # type: ignore[method-assign]


def _no_seal() -> None:
    """Store payloads as plain JSON, readable by anyone who asks the DHT."""
    sealing.PayloadSeal.__init__ = lambda self, secret: setattr(self, "_master", None)  # type: ignore[method-assign]


def _one_pool() -> None:
    """Every stream takes a member's slot before its handshake and holds it for the handshake's whole timeout."""
    StreamGuard.known = lambda self, peer: True  # type: ignore[method-assign]


DEFENCES: dict[str, Callable[[], None]] = {
    "key-check": _any_key,
    "tag-first": _verify_first,
    "stream-pools": _one_pool,
    "expiration-cap": _no_expiration_cap,
    "sealing": _no_seal,
}


def switch_off(argv: list[str]) -> list[str]:
    """Applies the ``--undefended NAMES`` of ``argv``; returns ``argv`` without it."""
    if "--undefended" not in argv:
        raise SystemExit("tests.integration.undefended needs --undefended NAME[,NAME...]: " + ", ".join(DEFENCES))
    at = argv.index("--undefended")
    for name in argv[at + 1].split(","):
        DEFENCES[name]()
    return argv[:at] + argv[at + 2:]


if __name__ == "__main__":
    sys.argv = switch_off(sys.argv)
    main()
