"""diloco: each peer takes inner steps alone, then the swarm averages the phase's parameter change and an outer
optimizer applies it. :class:`OuterState` holds the shared parameters; :class:`DilocoMode` runs the phases."""

from peerd.training.diloco.mode import DilocoMode
from peerd.training.diloco.outer import OuterState

__all__ = ["DilocoMode", "OuterState"]
