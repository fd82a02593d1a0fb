"""The pydantic config tree and its one loader.

Precedence, lowest to highest: field defaults < YAML file (``--config``) < environment (``PEERD_``, nested
with ``__``: ``PEERD_SWARM__INITIAL_PEERS='["/ip4/..."]'``) < CLI flags. :func:`load_config` is the only
place that merges them. Each component receives only its own sub-model (``SwarmConfig`` for the swarm, ...).
Unknown keys are errors at every level, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import contextvars
import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from peerd.errors import AddressError, ConfigError

ENV_PREFIX = "PEERD_"
DEFAULT_CONTROL_PORT = 7710
Role = Literal["trainer", "expert_host", "bootstrap", "observer"]  # what a peer advertises in its record


def _default_roles() -> list[Role]:
    return ["trainer"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SwarmConfig(_Section):
    """How this peer joins the swarm and what it tells others about itself."""

    initial_peers: list[str] = Field(
        default_factory=list,
        description="Multiaddrs of peers to bootstrap from, each ending in /p2p/<peer id>. "
        "Empty: this peer starts a new swarm.",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="Multiaddrs to listen on. 0.0.0.0 lets peers on other hosts connect (hivemind's own "
        "default, 127.0.0.1, would not); port 0 picks a free port.",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        description="Multiaddrs to announce to others instead of the detected ones (e.g. a public IP or a "
        "container DNS name). Ports must be explicit.",
    )
    identity_path: Path | None = Field(
        default=None,
        description="Private key file (from `peerd keygen`) that makes the peer id stable across restarts.",
    )
    roles: list[Role] = Field(default_factory=_default_roles, description="Roles advertised in this peer's record.")
    record_refresh_period: float = Field(
        default=5.0, gt=0, description="Seconds between re-publications of this peer's record."
    )
    record_ttl: float = Field(
        default=20.0, gt=0, description="Seconds a record stays in the DHT after its last refresh."
    )
    nat_port_map: bool = Field(
        default=False,
        description="Let p2pd ask the LAN's router for a port mapping (UPnP/NAT-PMP). Off by default: it sends "
        "discovery traffic to the local network; forward the port or set announce_maddrs instead.",
    )
    bootstrap_attempts: int = Field(default=3, ge=1, le=100, description="Tries to reach the initial peers.")
    bootstrap_retry_delay: float = Field(
        default=2.0, ge=0, description="Seconds before the first retry; doubles on each further try."
    )
    startup_timeout: float = Field(default=30.0, gt=0, description="Seconds for p2pd and the DHT to start.")
    request_timeout: float = Field(default=5.0, gt=0, description="Seconds for one DHT lookup or store.")

    @field_validator("initial_peers")
    @classmethod
    def _check_initial_peers(cls, value: list[str]) -> list[str]:
        from peerd.swarm.addresses import parse_peer_maddr

        return [str(parse_peer_maddr(item, field=f"swarm.initial_peers[{i}]")) for i, item in enumerate(value)]

    @field_validator("host_maddrs")
    @classmethod
    def _check_host_maddrs(cls, value: list[str]) -> list[str]:
        from peerd.swarm.addresses import parse_listen_maddr

        if not value:
            raise ValueError("at least one listen multiaddr is required")
        return [str(parse_listen_maddr(item, field=f"swarm.host_maddrs[{i}]")) for i, item in enumerate(value)]

    @field_validator("announce_maddrs")
    @classmethod
    def _check_announce_maddrs(cls, value: list[str]) -> list[str]:
        from peerd.swarm.addresses import parse_announce_maddr

        return [
            str(parse_announce_maddr(item, field=f"swarm.announce_maddrs[{i}]")) for i, item in enumerate(value)
        ]

    @model_validator(mode="after")
    def _check_ttl(self) -> SwarmConfig:
        if self.record_ttl <= self.record_refresh_period:
            raise ValueError(
                f"swarm.record_ttl ({self.record_ttl}) must exceed swarm.record_refresh_period "
                f"({self.record_refresh_period}), or records expire between refreshes: raise swarm.record_ttl"
            )
        return self


class ControlConfig(_Section):
    """The local control endpoint (HTTP) used by `peerd status` and, later, the status page and metrics."""

    host: str = Field(default="127.0.0.1", description="Address to bind; loopback unless `expose` is set.")
    port: int = Field(
        default=DEFAULT_CONTROL_PORT, ge=0, le=65535, description="TCP port; 0 picks a free one."
    )
    expose: bool = Field(
        default=False, description="Allow binding a non-loopback address (the endpoint has no authentication)."
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> ControlConfig:
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback and not self.expose:
            raise ValueError(
                f"control.host={self.host!r} is not a loopback address; the control endpoint has no "
                "authentication, so set control.expose: true to bind it anyway"
            )
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class LoggingConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level.")
    format: Literal["text", "json"] = Field(default="text", description="Log line format on stderr.")


class CodecConfig(_Section):
    """The 8-bit blockwise quantization codec used for averaging payloads."""

    block_size: int = Field(
        default=128, ge=8, le=65536,
        description="Elements per absmax-scaled block; 128 with bf16 scales is 1.016 bytes per element and a "
        "relative error of 6.5e-3 on Gaussian data (benchmarks/bench_codec.py has the sweep).",
    )
    min_compress_numel: int = Field(
        default=4096, ge=0, description="Tensors with fewer elements are sent as fp16 instead of 8-bit."
    )
    error_feedback: bool = Field(
        default=True, description="Carry each round's quantization residual into the next round."
    )
    lossless: bool = Field(
        default=False,
        description="Send raw values instead (used internally for parameter averaging, where 8-bit noise "
        "would be applied to the weights themselves).",
    )


class AveragingConfig(_Section):
    """Group formation and the all-reduce of gradients and parameters."""

    codec: CodecConfig = Field(default_factory=lambda: CodecConfig())
    target_group_size: int = Field(default=4, ge=2, le=64, description="Members per averaging group, at most.")
    min_group_size: int = Field(default=2, ge=2, description="Fewer ready peers than this: step alone.")
    matchmaking_window: float = Field(
        default=1.5, gt=0, description="Seconds the first ready peer waits for others before the group is fixed."
    )
    round_timeout: float = Field(
        default=20.0, gt=0, description="Seconds a reducer waits for contributions and a sender for its result."
    )
    join_timeout: float = Field(
        default=5.0, gt=0, description="Seconds a reducer waits for its own side of a round a sender already started."
    )
    chunk_numel: int = Field(
        default=2**19, ge=1024, le=2**26,
        description="Elements per streamed chunk: averages of early chunks flow back while later ones are sent. "
        "Must match across the swarm.",
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> AveragingConfig:
        if self.min_group_size > self.target_group_size:
            raise ValueError(
                f"averaging.min_group_size ({self.min_group_size}) exceeds averaging.target_group_size "
                f"({self.target_group_size}): lower min_group_size or raise target_group_size"
            )
        if self.join_timeout >= self.round_timeout:
            raise ValueError("averaging.join_timeout must be below averaging.round_timeout: lower join_timeout")
        return self


class TaskConfig(_Section):
    """What is trained: a built-in task or a custom ``package.module:function``."""

    name: str = Field(
        default="lm",
        pattern=r"^([a-z_]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="'synthetic' (teacher-student regression with a known optimum), 'lm' (byte-level "
        "transformer on the Python standard library's source files) or 'package.module:function'.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task-specific options, validated by the task (unknown keys are errors)."
    )
    seed: int = Field(default=0, description="Seed for the initial model; must match across the swarm.")
    shard_index: int | None = Field(
        default=None, ge=0, description="Which data shard this peer reads; default derived from the peer id."
    )
    num_shards: int = Field(default=16, ge=1, description="Number of data shards the data is split into.")

    @model_validator(mode="after")
    def _check_shard(self) -> TaskConfig:
        if self.shard_index is not None and self.shard_index >= self.num_shards:
            raise ValueError(
                f"training.task.shard_index ({self.shard_index}) must be below training.task.num_shards "
                f"({self.num_shards}): lower the index or raise num_shards"
            )
        return self


class CheckpointConfig(_Section):
    directory: Path | None = Field(
        default=None, description="Where checkpoints go; null disables them. `--resume` reads from here."
    )
    every_steps: int = Field(default=20, ge=1, description="Global steps between checkpoints.")
    keep: int = Field(default=3, ge=1, description="How many of the newest checkpoints to keep.")


class TrainingConfig(_Section):
    """Collaborative training; only peers with ``enabled: true`` train."""

    enabled: bool = Field(default=False, description="Train the task with the swarm.")
    task: TaskConfig = Field(default_factory=TaskConfig)
    optimizer: Literal["sgd", "adam", "adamw"] = Field(default="adam", description="Same on every peer.")
    lr: float = Field(default=3e-3, gt=0, allow_inf_nan=False, description="Learning rate.")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(default=0.0, ge=0, description="Weight decay.")
    target_batch_size: int = Field(
        default=256, ge=1,
        description="Samples summed over the swarm's peers per global optimizer step (unused when "
        "samples_per_step is set).",
    )
    samples_per_step: int | None = Field(
        default=None, ge=1,
        description="Lockstep mode: this peer contributes exactly this many samples (whole micro-batches: a "
        "multiple of the task's batch_size) to every global step, then stops computing and waits until every "
        "trainer at its step (or finishing the previous one) has its share too, at most lockstep_timeout; the "
        "global batch is samples_per_step times the trainers at the step. Group members are ordered by data "
        "shard, so with explicit training.task.shard_index values two runs of the same config see the same "
        "samples and average them the same way. null: contribute whatever was accumulated when the swarm "
        "reached target_batch_size (faster peers contribute more; results depend on timing).",
    )
    lockstep_timeout: float = Field(
        default=60.0, gt=0,
        description="Lockstep mode: seconds a peer that has its samples_per_step waits for the others' before "
        "averaging with those that have theirs (a dead peer also drops out once its progress record expires, "
        "after progress_ttl).",
    )
    max_steps: int | None = Field(default=None, ge=1, description="Stop training (keep serving) after this step.")
    wait_for_peers: int = Field(
        default=1, ge=1, description="Trainers (this one included) that must be up before the first step."
    )
    progress_period: float = Field(default=0.5, gt=0, description="Seconds between progress publications.")
    progress_ttl: float = Field(default=10.0, gt=0, description="Seconds a progress record stays valid.")
    state_averaging_every: int = Field(
        default=10, ge=0, description="Average parameters and optimizer state every N steps (0: never)."
    )
    validation_every: int = Field(default=5, ge=1, description="Compute validation loss every N steps.")
    sync_state_on_join: bool = Field(
        default=True, description="A peer joining a swarm already past step 0 downloads its state first."
    )
    max_state_bytes: int = Field(default=2**31, ge=1024, description="Largest state accepted from a peer.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    resume: bool = Field(default=False, description="Start from the newest usable checkpoint (--resume).")

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.resume and self.checkpoint.directory is None:
            raise ValueError("training.resume needs training.checkpoint.directory: set it (or drop --resume)")
        if self.progress_ttl <= self.progress_period:
            raise ValueError("training.progress_ttl must exceed training.progress_period: raise progress_ttl")
        if self.samples_per_step is not None and self.lockstep_timeout <= self.progress_period:
            # peers learn that the others are done through progress records, refreshed this often
            raise ValueError(
                f"training.lockstep_timeout ({self.lockstep_timeout}) must exceed training.progress_period "
                f"({self.progress_period}), or lockstep peers stop waiting before they could see each other: "
                "raise training.lockstep_timeout"
            )
        return self


EXPERT_UID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$"


class ExpertsConfig(_Section):
    """Experts this peer serves to the swarm's remote mixture-of-experts layers (section absent: none).

    Served uids are ``uid_prefix + str(i)`` for ``i`` in ``first_index .. first_index + count - 1``, or the
    explicit ``uids`` list. One host per uid: two hosts announcing the same uid overwrite each other's record.
    """

    uid_prefix: str = Field(
        default="ffn.0.", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,100}$",
        description="Prefix of the served expert uids; a MoE layer with the same prefix routes to them.",
    )
    count: int = Field(default=4, ge=1, le=1024, description="How many experts to serve.")
    first_index: int = Field(default=0, ge=0, description="Index of the first served expert (uid suffix).")
    uids: list[Annotated[str, Field(pattern=EXPERT_UID_PATTERN)]] | None = Field(
        default=None, min_length=1, max_length=1024,
        description="Explicit expert uids to serve instead of uid_prefix/count/first_index.",
    )
    module: str = Field(
        default="ffn", pattern=r"^(ffn|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="Expert architecture: 'ffn' (Linear, GELU, Linear) or 'package.module:Class', built as "
        "Class(hidden_dim, **module_options) and mapping [tokens, hidden_dim] to [tokens, hidden_dim].",
    )
    hidden_dim: int = Field(default=128, ge=1, le=65536, description="Input and output width (the caller's d_model).")
    ffn_dim: int = Field(default=512, ge=1, le=262144, description="Inner width of the built-in 'ffn' expert.")
    module_options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a custom module.")
    seed: int = Field(default=0, description="Initial parameters are drawn from this seed and each expert's uid.")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(default="adam", description="Optimizer of each expert.")
    lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False, description="Learning rate of the experts.")
    weight_decay: float = Field(default=0.0, ge=0, description="Weight decay of the experts.")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Clip each update's gradient to this L2 norm (null: no clipping)."
    )
    max_request_tokens: int = Field(default=16384, ge=1, description="Most tokens accepted in one call.")
    max_queued_tokens: int = Field(
        default=65536, ge=1, description="Most tokens waiting per expert; further calls get EXPERT_OVERLOADED."
    )
    batch_wait: float = Field(
        default=0.0, ge=0, le=1.0,
        description="Seconds a batch waits for more concurrent calls to the same expert before computing "
        "(calls that arrive while the expert computes are batched anyway).",
    )
    threads: int = Field(default=1, ge=1, le=64, description="Compute threads shared by the served experts.")
    keep_activations_tokens: int = Field(
        default=16384, ge=0,
        description="Most tokens (over all served experts) whose forward activations the host keeps for the "
        "caller's backward call, which then carries only output gradients and skips recomputing the forward "
        "pass; the oldest are dropped first (their callers resend the inputs). 0: always recompute.",
    )
    keep_activations_ttl: float = Field(
        default=60.0, gt=0, description="Seconds kept activations wait for their backward call before dropped."
    )
    announce_period: float = Field(default=5.0, gt=0, description="Seconds between re-announcements in the DHT.")
    record_ttl: float = Field(
        default=15.0, gt=0, description="Seconds an expert's DHT record outlives its last announcement."
    )

    @model_validator(mode="after")
    def _check(self) -> ExpertsConfig:
        if self.record_ttl <= self.announce_period:
            raise ValueError("experts.record_ttl must exceed experts.announce_period: raise record_ttl")
        if self.uids is not None and len(set(self.uids)) != len(self.uids):
            raise ValueError("experts.uids lists an expert twice: remove the duplicate")
        if self.max_request_tokens > self.max_queued_tokens:
            raise ValueError("experts.max_request_tokens exceeds experts.max_queued_tokens: lower it")
        return self

    @property
    def served_uids(self) -> list[str]:
        if self.uids is not None:
            return list(self.uids)
        return [f"{self.uid_prefix}{self.first_index + i}" for i in range(self.count)]


class MoEConfig(_Section):
    """A remote mixture-of-experts layer (e.g. ``training.task.options.moe`` of the ``lm`` task).

    Layer ``L`` routes among the experts ``uid_prefix.format(layer=L) + str(i)``, i < num_experts, that are
    alive in the DHT. Each token goes to the ``k`` best of them (softmax gate, top-k); the layer proceeds
    once ``k_min`` experts answered for every token and ``grace`` seconds passed (or all answered), and
    renormalizes the gate weights over the experts that answered. A token no expert answered for gets a
    zero output, so the block's residual connection passes it through unchanged.
    """

    layers: list[int] = Field(default_factory=lambda: [-1], min_length=1, max_length=64,
                              description="Blocks whose feed-forward is a remote MoE (-1: the last block).")
    num_experts: int = Field(default=4, ge=1, le=4096, description="Experts per MoE layer (router outputs).")
    uid_prefix: str = Field(
        default="ffn.{layer}.", pattern=r"^[A-Za-z0-9_{}][A-Za-z0-9_.:{}-]{0,100}$",
        description="Expert uid prefix; '{layer}' is replaced with the block index.",
    )
    k: int = Field(default=2, ge=1, le=64, description="Experts per token.")
    k_min: int = Field(default=1, ge=1, description="Answers per token before the grace period starts.")
    timeout: float = Field(default=3.0, gt=0, le=600, description="Seconds per expert call (forward or backward).")
    grace: float = Field(
        default=0.05, ge=0, description="Seconds to wait for the remaining experts once k_min answered per token."
    )
    noise: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Std of Gaussian noise added to router logits while training (exploration).",
    )
    aux_loss_weight: float = Field(
        default=0.01, ge=0, allow_inf_nan=False, description="Weight of the load-balancing auxiliary loss."
    )
    wire: Literal["fp16", "raw"] = Field(
        default="fp16", description="Tensor encoding on the wire: fp16 (raw when fp16 would overflow) or raw."
    )
    refresh_period: float = Field(default=2.0, gt=0, description="Seconds between reads of the expert records.")
    retry_after: float = Field(
        default=2.0, gt=0, description="Seconds a failed expert is skipped; doubles per failure up to 60 s."
    )

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.k > self.num_experts:
            raise ValueError(f"k ({self.k}) exceeds num_experts ({self.num_experts}): lower k")
        if self.k_min > self.k:
            raise ValueError(f"k_min ({self.k_min}) exceeds k ({self.k}): lower k_min")
        if self.grace > self.timeout:
            raise ValueError("grace must not exceed timeout: lower grace")
        return self

    def prefix_for(self, layer: int) -> str:
        return self.uid_prefix.replace("{layer}", str(layer))

    def uids_for(self, layer: int) -> list[str]:
        return [f"{self.prefix_for(layer)}{i}" for i in range(self.num_experts)]


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
