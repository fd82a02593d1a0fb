"""Swarms for the attack tests: private swarms, and peers run from a patched module (a liar, or peerd with one
defence switched off) beside honest ones. Not a test module: the tests import it."""

from __future__ import annotations

from pathlib import Path

from peerd.launcher import LocalSwarm, PeerProcess
from peerd.wire.membership import generate_secret
from tests.helpers import PATCHED_ENV

__all__ = ["honest_peer", "new_secret", "private", "spawn"]


def new_secret(log_dir: Path) -> Path:
    """A fresh swarm secret, kept in ``log_dir`` (made if missing)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    secret = log_dir / "swarm.secret"
    generate_secret(secret)
    return secret


def private(config: Path, log_dir: Path, *extra: str) -> LocalSwarm:
    """A swarm of ``config`` whose peers hold a fresh secret (:func:`new_secret`); ``extra``: more arguments for
    every peer."""
    return LocalSwarm(config, log_dir=log_dir, extra_args=["--swarm-secret", str(new_secret(log_dir)), *extra])


def spawn(swarm: LocalSwarm, name: str, module: str = "peerd", extra: tuple[str, ...] = ()) -> PeerProcess:
    """A peer of ``swarm`` run from ``module`` (peerd, or a patched one under tests/), joining through the first
    peer started."""
    args = ["--config", str(swarm.config_path), "--control-port", "0", *swarm.extra_args, *extra]
    if swarm.peers:
        args += ["--initial-peers", swarm.peers[0].ready["maddrs"][0]]
    peer = PeerProcess(name, args, swarm.log_dir, env=PATCHED_ENV, module=module)
    swarm.peers.append(peer)
    return peer


def honest_peer(swarm: LocalSwarm, name: str, undefended: str | None) -> PeerProcess:
    """An honest peer: peerd, or with ``undefended`` (tests/integration/undefended.py) that defence off."""
    if undefended is None:
        return spawn(swarm, name)
    return spawn(swarm, name, "tests.integration.undefended", ("--undefended", undefended))
