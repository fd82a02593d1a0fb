"""Who belongs to a swarm: a shared secret, an allowlist of peer ids, both, or neither (an open swarm).

libp2p already authenticates every connection's peer id (noise/TLS), so an allowlist needs no cryptography
of its own: a peer id on a stream or in a signed record is the key holder's. A secret cannot be seen on the
wire, so its holders prove it with HMAC-SHA256 tags over fresh, per-use inputs: the stream handshake
(``handshake.py``) binds both peer ids and both sides' nonces, a record tag (``peerd.swarm.signing``) binds
the signer and the record. The secret itself never leaves the machine.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from peerd.config import SwarmConfig
from peerd.errors import ConfigError

__all__ = ["SECRET_BYTES", "Membership", "generate_secret", "load_allowlist", "load_secret", "membership_from_config"]

SECRET_BYTES = 32
_SECRET_TEXT = re.compile(r"[0-9a-f]{64}")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
MAX_ALLOWLIST = 100_000


@dataclass(frozen=True)
class Membership:
    secret: bytes | None = None
    allowlist: frozenset[str] | None = None

    @property
    def open(self) -> bool:
        return self.secret is None and self.allowlist is None

    def describe(self) -> str:
        if self.open:
            return "open"
        parts = ["swarm secret"] if self.secret is not None else []
        if self.allowlist is not None:
            parts.append(f"allowlist of {len(self.allowlist)} peer ids")
        return "private (" + " + ".join(parts) + ")"

    def admits(self, peer_id: str) -> bool:
        """The allowlist's verdict on ``peer_id`` (a secret is proven separately, by a tag)."""
        return self.allowlist is None or peer_id in self.allowlist

    def tag(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the secret over ``label`` and ``parts``, each length-prefixed so that no two
        different inputs share an encoding; empty in a swarm without a secret."""
        if self.secret is None:
            return b""
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in (label, *parts):
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        return mac.digest()

    def check_tag(self, tag: bytes, label: bytes, *parts: bytes) -> bool:
        if self.secret is None:
            return True
        return hmac.compare_digest(tag, self.tag(label, *parts))


def generate_secret(path: Path, overwrite: bool = False) -> None:
    """Writes a new random secret to ``path`` (mode 0600, hex text); never replaces one unless told to."""
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; refusing to replace a swarm secret (pass --force)",
                          field="swarm.secret_path")
    if not path.parent.is_dir():
        raise ConfigError(f"directory {path.parent} does not exist", field="swarm.secret_path")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        f.write(secrets.token_bytes(SECRET_BYTES).hex() + "\n")


def load_secret(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"swarm.secret_path: cannot read {path}: {e}", field="swarm.secret_path") from e
    if not _SECRET_TEXT.fullmatch(text):
        raise ConfigError(
            f"swarm.secret_path: {path} is not a peerd swarm secret (64 hex digits); make one with "
            "`peerd keygen --swarm-secret PATH`", field="swarm.secret_path")
    return bytes.fromhex(text)


def load_allowlist(path: Path) -> frozenset[str]:
    """One peer id per line; blank lines and ``#`` comments are ignored; a bad line is an error naming it."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"swarm.allowlist_path: cannot read {path}: {e}", field="swarm.allowlist_path") from e
    return frozenset(_peer_ids(lines, path))


def _peer_ids(lines: Iterable[str], path: Path) -> Iterable[str]:
    count = 0
    for number, line in enumerate(lines, 1):
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        if not _PEER_ID.fullmatch(item):
            raise ConfigError(f"swarm.allowlist_path: {path}:{number}: {item[:80]!r} is not a peer id",
                              field="swarm.allowlist_path")
        count += 1
        if count > MAX_ALLOWLIST:
            raise ConfigError(f"swarm.allowlist_path: {path} lists more than {MAX_ALLOWLIST} peer ids",
                              field="swarm.allowlist_path")
        yield item


def membership_from_config(config: SwarmConfig) -> Membership:
    """Reads ``swarm.secret_path`` and ``swarm.allowlist_path``; ConfigError naming the option if unusable."""
    secret = load_secret(config.secret_path) if config.secret_path is not None else None
    allowlist = load_allowlist(config.allowlist_path) if config.allowlist_path is not None else None
    return Membership(secret, allowlist)
