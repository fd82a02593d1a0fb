"""The pydantic config tree and its one loader.

Precedence, lowest to highest: field defaults < YAML file (``--config``) < environment (``PEERD_``, nested
with ``__``: ``PEERD_SWARM__INITIAL_PEERS='["/ip4/..."]'``) < CLI flags. :func:`load_config` is the only
place that merges them. Each component receives only its own sub-model (``SwarmConfig`` for the swarm, ...).
Unknown keys are errors at every level, so a typo never silently falls back to a default.
"""

from peerd.config.experts import EXPERT_UID_PATTERN, ExpertsConfig, MoEConfig
from peerd.config.loader import (
    ENV_PREFIX,
    PeerdConfig,
    config_error_from,
    dump_config,
    load_config,
    parse_overrides,
    read_yaml,
    set_dotted,
)
from peerd.config.peer import (
    DEFAULT_CONTROL_PORT,
    ControlConfig,
    LoggingConfig,
    Role,
    StreamLimits,
    SwarmConfig,
)
from peerd.config.relay import Reachability, RelayConfig, RelayLimits
from peerd.config.training import (
    AveragingConfig,
    CheckpointConfig,
    CodecConfig,
    ExportConfig,
    StateTransferConfig,
    TaskConfig,
    TrainingConfig,
)
from peerd.config.verification import VerificationConfig

__all__ = [
    "DEFAULT_CONTROL_PORT",
    "ENV_PREFIX",
    "EXPERT_UID_PATTERN",
    "AveragingConfig",
    "CheckpointConfig",
    "CodecConfig",
    "ControlConfig",
    "ExpertsConfig",
    "ExportConfig",
    "LoggingConfig",
    "MoEConfig",
    "PeerdConfig",
    "Reachability",
    "RelayConfig",
    "RelayLimits",
    "Role",
    "StateTransferConfig",
    "StreamLimits",
    "SwarmConfig",
    "TaskConfig",
    "TrainingConfig",
    "VerificationConfig",
    "config_error_from",
    "dump_config",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "set_dotted",
]
