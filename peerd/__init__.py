"""peerd: a decentralized peer-to-peer training daemon built on hivemind."""

from peerd.config import PeerdConfig, load_config
from peerd.errors import PeerdError

__version__ = "0.1.0"

__all__ = ["PeerdConfig", "PeerdError", "__version__", "load_config"]
