"""Persistent peer identities: a libp2p private key file whose peer id stays the same across restarts."""

from __future__ import annotations

import os
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from peerd.errors import IdentityError


def generate_identity(path: Path, overwrite: bool = False) -> str:
    """Writes a new private key to ``path`` (mode 0400) and returns its peer id."""
    if path.exists() and not overwrite:
        raise IdentityError(f"{path} already exists; refusing to replace an identity (pass --force)", path=path)
    if not path.parent.is_dir():
        raise IdentityError(f"directory {path.parent} does not exist", path=path)
    if path.exists():
        os.chmod(path, 0o600)
        path.unlink()
    P2P.generate_identity(str(path))
    return load_peer_id(path)


def load_peer_id(path: Path) -> str:
    """The peer id of the key in ``path``; raises :class:`IdentityError` for a missing or foreign file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror or e}", path=path) from e
    try:
        return str(PeerID.from_identity(data))
    except Exception as e:  # hivemind raises protobuf/crypto errors of several types for foreign files
        raise IdentityError(
            f"{path} is not a peerd/libp2p private key ({type(e).__name__}); create one with `peerd keygen`",
            path=path,
        ) from e
