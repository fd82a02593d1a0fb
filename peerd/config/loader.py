"""The root of the tree and its one loader: defaults < YAML < ``PEERD_*`` env < CLI."""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from peerd.config.experts import ExpertsConfig
from peerd.config.peer import ControlConfig, LoggingConfig, SwarmConfig
from peerd.config.training import AveragingConfig, TrainingConfig
from peerd.errors import AddressError, ConfigError

ENV_PREFIX = "PEERD_"


class PeerdConfig(BaseSettings):
    """Everything a peer needs. Each section below is handed only to the component that owns it."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    run_name: str = Field(
        default="peerd-demo",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Name of the swarm; peers only see records of the same run.",
    )
    shutdown_timeout: float = Field(default=8.0, gt=0, description="Seconds for a graceful shutdown.")
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    experts: ExpertsConfig | None = Field(
        default=None, description="Experts this peer serves to remote MoE layers; absent: serves none."
    )
    control: ControlConfig = Field(default_factory=ControlConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _outer_momentum(self) -> PeerdConfig:
        """Top-k's residual is the outer momentum unless one is set (``training.diloco.outer_momentum``)."""
        diloco = self.training.diloco
        if self.averaging.codec.scheme == "topk" and "outer_momentum" not in diloco.model_fields_set:
            diloco.__dict__["outer_momentum"] = 0.0  # without validate_assignment's re-run of the validators
        return self

    @property
    def light(self) -> bool:
        """A peer that neither trains nor serves experts: a bootstrap or relay node, kept small."""
        return not self.training.enabled and self.experts is None

    @property
    def dht_in_process(self) -> bool:
        """Whether hivemind's DHT node runs on the daemon's loop (``swarm.dht_host``)."""
        host = self.swarm.dht_host
        return host == "daemon" or (host == "auto" and self.light)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First source wins: CLI (passed as init kwargs) > env > YAML > field defaults.
        return init_settings, env_settings, _YamlSource(settings_cls)


# No default: a shared mutable default dict could leak one load's YAML into another; unset means "no YAML".
_yaml_data: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("peerd_yaml_data")


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the already-parsed YAML mapping of the current load into pydantic-settings' merge."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _yaml_data.get({}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get({}))


def set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"-o {dotted}: {part!r} is set twice", field=dotted)
        node = child
    node[parts[-1]] = value


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``-o section.key=value`` items (values parsed as YAML) as a nested override mapping."""
    result: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"-o {item!r}: expected section.key=value", field="-o")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(result, key.strip(), value)
    return result


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}", field="--config") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}", field="--config") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level, got {type(data).__name__}")
    return data


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> PeerdConfig:
    """Builds the effective config: defaults < YAML at ``path`` < ``PEERD_*`` env < ``overrides`` (CLI).

    ``overrides`` is a nested mapping such as ``{"swarm": {"initial_peers": [...]}}``; pydantic-settings
    deep-merges it over the lower sources, so a CLI flag replaces only the field it names.
    """
    token = _yaml_data.set(read_yaml(path) if path is not None else {})
    try:
        return PeerdConfig(**(overrides or {}))
    except ValidationError as e:
        raise config_error_from(e, source=str(path) if path else None) from None
    finally:
        _yaml_data.reset(token)


def config_error_from(error: ValidationError, source: str | None = None) -> ConfigError:
    """One readable message per invalid field, naming it in YAML dotted form and its env variable."""
    lines = []
    first_field = None
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        first_field = first_field or field
        cause = item.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, Exception) else item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown option (check the spelling; `peerd config show` lists all options)"
        env = ENV_PREFIX + "__".join(str(p).upper() for p in item["loc"] if not isinstance(p, int))
        shown = item.get("input")
        value = "" if item["type"] in ("missing", "extra_forbidden") or isinstance(shown, dict) else f" = {shown!r}"
        lines.append(f"  {field}{value}: {message} (YAML key {field}, env {env})")
    where = f" in {source}" if source else ""
    cls = AddressError if any("multiaddr" in line for line in lines) else ConfigError
    return cls(f"invalid configuration{where}:\n" + "\n".join(lines), field=first_field)


def dump_config(config: PeerdConfig) -> str:
    text: str = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    return text
