"""Sections for collaborative training: the codec, averaging rounds, the task, checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from peerd.config.base import Section
from peerd.config.diloco import DilocoConfig
from peerd.config.verification import VerificationConfig


class CodecConfig(Section):
    """The 8-bit blockwise quantization codec used for averaging payloads."""

    scheme: Literal["blockwise8", "blockwise4", "blockwise2", "topk"] = Field(
        default="blockwise8",
        description="How averaged values are coded: every element at 8, 4 or 2 bits plus one bf16 scale per "
        "block (2 bits: -1, 0 or 1 times the block's largest value), or `topk`: only the `density` share of "
        "each payload's largest elements, their positions and their values at `value_bits`. Narrower codes move "
        "fewer bytes and lose more per round; error feedback carries the loss into the next round, so all but "
        "blockwise8 need `averaging.codec.error_feedback`. Meant for diloco's pseudo-gradients; state averaging "
        "stays lossless. Peers of one swarm may differ: every peer decodes every scheme.",
    )
    density: float = Field(default=0.0156, gt=0.0, le=1.0, description="topk: the share of each payload's "
                           "elements that travel (the largest in magnitude).")
    value_bits: Literal[8, 4, 2] = Field(default=2, description="topk: bits of each sent value's code.")
    block_size: int = Field(
        default=128, ge=8, le=65536,
        description="Elements per absmax-scaled block. Each block carries its own bf16 scale (2 bytes; at 128 "
        "that is 1.016 bytes per element): smaller blocks follow the values more closely and cost more bytes.",
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


class AveragingConfig(Section):
    """Group formation and the all-reduce of gradients and parameters."""

    codec: CodecConfig = Field(default_factory=lambda: CodecConfig())
    target_group_size: int = Field(
        default=4, ge=2, le=64, description="Members per averaging group, at most. Must match across the swarm: "
        "members refuse a leader's groups that are not split by it.")
    min_group_size: int = Field(
        default=2, ge=2, description="Fewer ready peers than this: step alone. Must match across the swarm.")
    matchmaking_window: float = Field(
        default=1.5, gt=0, description="Seconds the first ready peer waits for others before the group is fixed "
        "(at least: it waits longer while the DHT answers slowly, up to max_matchmaking_window).",
    )
    max_matchmaking_window: float = Field(
        default=10.0, gt=0,
        description="Seconds the first ready peer waits at most when the DHT answers slowly: the window grows to "
        "6 times the median time of this peer's recent DHT requests, so registrations that take that long to "
        "arrive still make the round. Peers give up waiting for a group decision after this plus join_timeout.",
    )
    round_timeout: float = Field(
        default=20.0, gt=0, description="Seconds a reducer waits for contributions and a sender for its result."
    )
    join_timeout: float = Field(
        default=5.0, gt=0, description="Seconds a reducer waits for its own side of a round a sender already started; "
        "also the most a member seen absent lately is waited for beyond the rest of a round (at least a fifth of it).")
    chunk_numel: int = Field(
        default=2**19, ge=1024, le=2**26,
        description="Elements per streamed chunk: averages of early chunks flow back while later ones are sent. "
        "Must match across the swarm.",
    )
    aggregation: Literal["centered_clip", "trimmed_mean", "mean"] = Field(
        default="centered_clip",
        description="How a reducer combines its span's contributions. 'centered_clip' (robust: each member's "
        "deviation from the group's center is clipped to clip_radius times the median deviation) and "
        "'trimmed_mean' (robust: per coordinate the highest and lowest quarter are dropped) cap claimed "
        "weights (max_weight_ratio) and need every member's chunk before combining it; groups of 2 have no "
        "majority, so each row is scaled to the smaller norm of the two before the capped-weight mean. 'mean' trusts every member: the weighted mean of "
        "the claimed weights, summed as chunks arrive. The reducer decides; members apply its result.",
    )
    max_weight_ratio: float = Field(
        default=1.0, ge=1.0, allow_inf_nan=False,
        description="Robust aggregation: a member's claimed weight (samples) counts at most this many times "
        "the group's (lower) median claim. 1: nobody outweighs the median member. An attacker's clipped "
        "contribution pulls the result by its weight share, so a larger ratio lets one that claims many "
        "samples pull it further.",
    )
    clip_radius: float = Field(
        default=2.0, gt=0, allow_inf_nan=False,
        description="centered_clip: clip each deviation from the center to this many times the median "
        "distance of the members from it. Smaller clips honest members' contributions too, which shrinks "
        "the steps of honest rounds; larger lets an attacker pull further.",
    )
    clip_iterations: int = Field(
        default=3, ge=1, le=50, description="centered_clip: fixed-point iterations per chunk."
    )
    verification: VerificationConfig = Field(default_factory=lambda: VerificationConfig())

    @model_validator(mode="after")
    def _check_sizes(self) -> AveragingConfig:
        if self.min_group_size > self.target_group_size:
            raise ValueError(
                f"averaging.min_group_size ({self.min_group_size}) exceeds averaging.target_group_size "
                f"({self.target_group_size}): lower min_group_size or raise target_group_size"
            )
        if self.join_timeout >= self.round_timeout:
            raise ValueError("averaging.join_timeout must be below averaging.round_timeout: lower join_timeout")
        if self.codec.scheme != "blockwise8" and not self.codec.error_feedback and not self.codec.lossless:
            raise ValueError(
                f"averaging.codec.scheme {self.codec.scheme} needs averaging.codec.error_feedback: without it, "
                "what narrow codes drop is lost every round: set error_feedback to true or use blockwise8"
            )
        if self.max_matchmaking_window < self.matchmaking_window:
            raise ValueError(
                f"averaging.max_matchmaking_window ({self.max_matchmaking_window}) is below "
                f"averaging.matchmaking_window ({self.matchmaking_window}): raise max_matchmaking_window"
            )
        return self


class TaskConfig(Section):
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


class StateTransferConfig(Section):
    """How joiners download the training state, and how much a donor serves at once."""

    stall_timeout: float = Field(
        default=30.0, gt=0,
        description="Seconds without a byte after which a joiner leaves a donor for the next one (resuming where "
        "it stopped if that one holds the same step) and a donor drops the joiner. No total deadline: a large "
        "state on a slow link takes as long as it takes.",
    )
    max_transfers: int = Field(
        default=4, ge=1, le=64,
        description="Transfers a donor serves at once, all from one snapshot of its state; more are told busy.",
    )
    vouchers: int = Field(
        default=1, ge=0, le=64,
        description="Members besides the donor that must publish the same digest of a state before a joiner "
        "loads it, and the number of other members beyond one that must be ahead before a peer believes "
        "it is behind. k defends against k members that lie together (with an allowlist; a swarm secret "
        "alone lets one attacker mint any number of members). A peer that sees k or fewer other members "
        "needs all of them. 0: one donor's word is enough (docs: security).",
    )


class CheckpointConfig(Section):
    """Checkpoints of the training state on local disk."""

    directory: Path | None = Field(
        default=None, description="Where checkpoints go; null disables them. `--resume` reads from here."
    )
    every_steps: int = Field(default=20, ge=1, description="Global steps between checkpoints.")
    keep: int = Field(default=3, ge=1, description="How many of the newest checkpoints to keep.")


class ExportConfig(Section):
    """Writing the trained model out when the run ends (``peerd export`` does the same from a checkpoint)."""

    directory: Path | None = Field(
        default=None,
        description="Where the trainer exports the model when it reaches training.max_steps: a new or empty "
        "directory (the hf task: one from_pretrained loads; other tasks: model.safetensors and task.json). "
        "null: no export.",
    )
    merge_lora: bool = Field(
        default=False,
        description="LoRA runs: export the base model with the adapters merged in (the adapters themselves "
        "under adapter/) instead of the adapters alone.",
    )


class TrainingConfig(Section):
    """Collaborative training; only peers with ``enabled: true`` train."""

    enabled: bool = Field(default=False, description="Train the task with the swarm.")
    task: TaskConfig = Field(default_factory=TaskConfig)
    mode: Literal["sync", "diloco"] = Field(
        default="sync",
        description="'sync': gradients are averaged at every global step (LAN, small models). 'diloco': "
        "each peer takes training.diloco.inner_steps steps alone, then the phase's parameter change is "
        "averaged and applied by an outer optimizer (internet links; docs: training modes).",
    )
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda|cuda:\d+|mps)$",
        description="Where the model and batches live: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda', "
        "'cuda:N' or 'mps'. What crosses the wire is staged through reused CPU buffers.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="'bf16': forward and loss under bfloat16 autocast (weights stay fp32)."
    )
    optimizer: Literal["sgd", "adam", "adamw"] = Field(
        default="adam", description="Same on every peer; in diloco mode the inner optimizer (default adamw)."
    )
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
    state_transfer: StateTransferConfig = Field(default_factory=StateTransferConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    resume: bool = Field(default=False, description="Start from the newest usable checkpoint (--resume).")

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.mode == "diloco" and "optimizer" not in self.model_fields_set:
            # DiLoCo's inner optimizer is AdamW; set without validate_assignment's re-run of this validator
            self.__dict__["optimizer"] = "adamw"
        if self.mode == "diloco" and self.samples_per_step is not None:
            raise ValueError(
                "training.samples_per_step is sync mode's lockstep; in diloco mode use "
                "training.diloco.phase_end: lockstep (each peer takes exactly inner_steps steps): unset "
                "training.samples_per_step"
            )
        if self.export.directory is not None and self.max_steps is None:
            raise ValueError("training.export.directory is written when training reaches training.max_steps: set "
                             "max_steps (or export a checkpoint with `peerd export`)")
        if self.resume and self.checkpoint.directory is None:
            raise ValueError("training.resume needs training.checkpoint.directory: set it (or drop --resume)")
        if self.mode == "sync" and self.sync_state_on_join and self.state_averaging_every == 0:
            raise ValueError(
                "training.sync_state_on_join loads a state that members agree on, which sync mode makes by "
                "state averaging: set training.state_averaging_every (e.g. 10), or sync_state_on_join: false"
            )
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
