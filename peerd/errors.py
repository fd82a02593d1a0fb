"""The one error hierarchy of peerd.

Every error peerd raises on purpose derives from :class:`PeerdError`, so callers (and the CLI, which turns
them into a one-line message and a non-zero exit code) can catch them in one place::

    PeerdError
    ├── ConfigError              a config file, env var or CLI flag is invalid (names the field and value)
    │   └── AddressError         a user-typed multiaddr is malformed or unusable
    ├── IdentityError            an identity key file is missing, unreadable or not a key
    ├── ClockSkewError           this machine's clock is further off the swarm's than the DHT admits (``offset``)
    ├── TransportError           talking to other peers failed
    │   ├── BootstrapError       no initial peer could be reached after bounded retries, or one refused us
    │   ├── PeerUnreachable      one peer could not be reached
    │   └── RPCTimeout           a call to a peer did not finish in time
    ├── ProtocolViolation        a peer sent something invalid (record, tensor, message); names the peer
    │   └── CodecError           a compressed tensor payload failed validation
    ├── MembershipError          a stream's membership handshake failed or was refused (names the peer, the reason)
    ├── ActivationsGone          an expert host no longer keeps a call's activations (resend the inputs)
    ├── AveragingError           an averaging round could not complete
    │   └── GroupFailed          the group fell apart or could not be formed in time
    ├── StateError               a checkpoint or a downloaded training state is unusable (model untouched)
    ├── ControlError             the local control endpoint could not be started or reached
    └── DaemonError              the daemon or one of its child processes failed

Errors carry context as attributes (``peer_id``, ``field``, ``address``) in addition to the message.
"""

from __future__ import annotations

from typing import Any


class PeerdError(Exception):
    """Base of all errors raised by peerd on purpose."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)


class ConfigError(PeerdError):
    """Invalid configuration; ``field`` names the option to change when known."""


class AddressError(ConfigError, ValueError):
    """A malformed or unusable multiaddr; ``field`` and ``address`` say which.

    Also a ``ValueError`` so that pydantic validators report it as a field error of the config.
    """


class IdentityError(PeerdError):
    """An identity key file that cannot be used."""


class ClockSkewError(PeerdError):
    """The DHT refused to join: this machine's clock is ``offset`` seconds off an initial peer's (``peers``),
    more than hivemind admits; retrying cannot help, syncing the clock does."""


class TransportError(PeerdError):
    """Communication with other peers failed."""


class BootstrapError(TransportError):
    """No initial peer answered; ``addresses`` lists what was tried."""


class PeerUnreachable(TransportError):
    """A specific peer (``peer_id``) could not be reached."""


class RPCTimeout(TransportError):
    """A call to ``peer_id`` did not complete within its timeout."""


class ProtocolViolation(PeerdError):
    """A peer (``peer_id``) sent data that failed validation."""


class CodecError(ProtocolViolation):
    """A compressed tensor payload is malformed or inconsistent with its announced shape."""


class MembershipError(PeerdError):
    """A stream to or from ``peer_id`` was refused for membership: no or another swarm secret, not on the
    allowlist, or a limit; ``code`` is the handshake's ``HandshakeCode`` name."""


class ActivationsGone(PeerdError):
    """An expert host (``peer_id``) dropped the activations a backward call referred to; not a fault: the
    caller repeats the call with the inputs."""


class AveragingError(PeerdError):
    """An averaging round could not complete."""


class GroupFailed(AveragingError):
    """The averaging group could not be formed or lost members mid-round."""


class StateError(PeerdError):
    """A checkpoint or training state that cannot be used; ``source`` names the file or peer."""


class ControlError(PeerdError):
    """The local control endpoint could not be started or reached."""


class DaemonError(PeerdError):
    """The daemon or one of its child processes failed."""
