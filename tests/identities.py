"""Libp2p identities for tests: the key file a p2pd starts with, and the signer that certifies the key its
all-reduce signs round messages with (peerd.averaging.verify.keys)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from hivemind.p2p import P2P

from peerd.swarm.signing import RecordSigner
from peerd.wire.membership import Membership


def new_identity(directory: Path, name: str) -> tuple[Path, RecordSigner]:
    """A fresh identity key in ``directory``/``name`` and its signer."""
    path = directory / name
    P2P.generate_identity(str(path))
    return path, RecordSigner(path.read_bytes(), Membership())


@functools.cache
def signers(count: int) -> tuple[RecordSigner, ...]:
    """``count`` identities, made once per test session (an RSA key takes ~0.1 s), sorted by peer id."""
    directory = Path(tempfile.mkdtemp(prefix="peerd-identities-"))
    made = [new_identity(directory, f"id{i}")[1] for i in range(count)]
    return tuple(sorted(made, key=lambda signer: signer.peer_id))
