"""Expert architectures: the built-in feed-forward block, or a custom ``package.module:Class``.

Every expert maps ``[tokens, hidden_dim]`` to ``[tokens, hidden_dim]`` and is initialized from
``experts.seed`` and its own uid, so a restarted host serves the same initial expert (until it learns).
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Any

import torch
from torch import nn

from peerd.config import ExpertsConfig
from peerd.errors import ConfigError

__all__ = ["FeedForwardExpert", "build_expert"]

INIT_STD = 0.02


class FeedForwardExpert(nn.Module):
    """Linear, GELU, Linear: the usual transformer feed-forward block."""

    def __init__(self, hidden_dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden_dim, ffn_dim)
        self.down = nn.Linear(ffn_dim, hidden_dim)
        for layer in (self.up, self.down):
            nn.init.normal_(layer.weight, std=INIT_STD)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.nn.functional.gelu(self.up(x)))
        return out


def _expert_seed(seed: int, uid: str) -> int:
    digest = hashlib.sha256(repr((seed, "expert", uid)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _custom_class(spec: str) -> Any:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(
            f"experts.module {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}",
            field="experts.module",
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None or not callable(cls):
        raise ConfigError(
            f"experts.module {spec!r}: {module_name!r} has no class {class_name!r}", field="experts.module"
        )
    return cls


def build_expert(config: ExpertsConfig, uid: str) -> nn.Module:
    """Builds and checks one expert; raises ConfigError if it is not a [n, d] -> [n, d] float module."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_expert_seed(config.seed, uid))
        if config.module == "ffn":
            if config.module_options:
                raise ConfigError(
                    "experts.module_options only applies to a custom experts.module",
                    field="experts.module_options",
                )
            expert: nn.Module = FeedForwardExpert(config.hidden_dim, config.ffn_dim)
        else:
            try:
                expert = _custom_class(config.module)(config.hidden_dim, **config.module_options)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(
                    f"experts.module {config.module!r} could not be built: {type(e).__name__}: {e}",
                    field="experts.module",
                ) from e
    if not isinstance(expert, nn.Module) or not any(p.requires_grad for p in expert.parameters()):
        raise ConfigError(
            f"experts.module {config.module!r} must build an nn.Module with trainable parameters",
            field="experts.module",
        )
    expert = expert.float()
    with torch.no_grad():
        try:
            probe = expert(torch.zeros(2, config.hidden_dim))
        except Exception as e:
            raise ConfigError(
                f"experts.module {config.module!r} fails on a [2, {config.hidden_dim}] input: "
                f"{type(e).__name__}: {e}",
                field="experts.module",
            ) from e
    if not isinstance(probe, torch.Tensor) or tuple(probe.shape) != (2, config.hidden_dim):
        shape = tuple(probe.shape) if isinstance(probe, torch.Tensor) else type(probe).__name__
        raise ConfigError(
            f"experts.module {config.module!r} maps [2, {config.hidden_dim}] to {shape}; it must "
            "keep the shape",
            field="experts.module",
        )
    return expert
