"""Sections for remote mixture-of-experts: the experts a peer serves and the layers that call them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from peerd.config.base import Section

EXPERT_UID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$"
# of a host's DHT record (at most 32 KiB in all, peerd.swarm.signing.MAX_PAYLOAD), what its uids may take
MAX_ANNOUNCED_UID_BYTES = 16 * 1024


class ExpertsConfig(Section):
    """Experts this peer serves to the swarm's remote mixture-of-experts layers (section absent: none).

    Served uids are ``uid_prefix + str(i)`` for ``i`` in ``first_index .. first_index + count - 1``, or the
    explicit ``uids`` list. One host per uid: a caller keeps the host it routes a uid to while that host
    announces it, and routes a uid that two hosts announce when it first sees them to neither.
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
    max_queued_tokens_per_caller: int | None = Field(
        default=None, ge=1, description="Most tokens one caller may have waiting per expert; its further calls get "
        "EXPERT_OVERLOADED while the rest of the queue stays open to other callers (null: a quarter of "
        "max_queued_tokens, and at least max_request_tokens).")
    max_caller_gradient_ratio: float | None = Field(
        default=2.0, ge=1, allow_inf_nan=False,
        description="A backward call's output gradients, per token, are scaled down to at most this many times the "
        "typical caller's (the lower median over recent callers of each one's recent calls), so that no caller "
        "steers an expert's update alone (null: no bound).")
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
        announced = sum(len(uid) + 3 for uid in self.served_uids)
        if announced > MAX_ANNOUNCED_UID_BYTES:
            raise ValueError(f"experts: the served uids take {announced} bytes of the host's DHT record, more than "
                             f"{MAX_ANNOUNCED_UID_BYTES}: serve fewer experts on this host (experts.count, experts.uids) "
                             "or give them shorter uids")
        if self.max_request_tokens > self.max_queued_tokens:
            raise ValueError("experts.max_request_tokens exceeds experts.max_queued_tokens: lower it")
        per_caller = self.max_queued_tokens_per_caller
        if per_caller is not None and not self.max_request_tokens <= per_caller <= self.max_queued_tokens:
            raise ValueError(f"experts.max_queued_tokens_per_caller ({self.max_queued_tokens_per_caller}) must lie "
                             f"between experts.max_request_tokens ({self.max_request_tokens}) and "
                             f"experts.max_queued_tokens ({self.max_queued_tokens}): set it in that range")
        return self

    @property
    def queued_tokens_per_caller(self) -> int:
        if self.max_queued_tokens_per_caller is not None:
            return self.max_queued_tokens_per_caller
        return max(self.max_request_tokens, self.max_queued_tokens // 4)

    @property
    def served_uids(self) -> list[str]:
        if self.uids is not None:
            return list(self.uids)
        return [f"{self.uid_prefix}{self.first_index + i}" for i in range(self.count)]


class MoEConfig(Section):
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
    max_answer_ratio: float | None = Field(
        default=4.0, ge=1, allow_inf_nan=False,
        description="A host's forward answer whose gain (per-token norm over the inputs') is over this many times "
        "the typical host's (the lower median over recent hosts of each one's recent answers) is left out like a "
        "failed call and its expert skipped for retry_after seconds, doubling while it goes on; while fewer than 3 "
        "hosts, this peer's own experts not among them, set the bound, it is scaled down to it instead. Input "
        "gradients over their own bound are scaled down to it. No host swamps the tokens routed to it (null: no "
        "bound).")
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
