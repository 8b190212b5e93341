"""Configuration of the reward tier: which scorers, their weights, and micro-batching.

Torch-free (imports only pydantic and ``streamrl.common``): a recipe is validated before any
model is loaded. Scorers are a discriminated union on ``type``:

* ``function``: a user Python function ``reward_func(queries, prompts, labels, **kwargs)``;
* ``http``: a remote reward service speaking the OpenRLHF JSON protocol;
* ``model``: a local Hugging Face reward model (sequence classification or LM + value head).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig
from streamrl.common.redact import redact_url


class _ScorerBase(BaseConfig):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Scorer name; prefixes its metrics (``{name}/reward``) and appears in the provenance."""
    weight: float = Field(1.0, ge=0)
    """Weight of this scorer's reward and score in the combined values (0 = log only)."""


class FunctionScorerConfig(_ScorerBase):
    """A Python reward function, OpenRLHF-compatible: ``reward_func(queries, prompts, labels, **kwargs)``."""

    type: Literal["function"] = "function"
    """Scorer kind: a Python reward function."""
    path: str = Field(min_length=1)
    """``/path/to/file.py`` or ``pkg.module``, optionally ``:func_name`` (default ``reward_func``)."""
    timeout_s: float = Field(300.0, gt=0)
    """A call that takes longer fails (s), counted from when it starts running. A sync function keeps
    running in its thread; a sample whose call alone timed out is not started again while that call
    runs (its deliveries fail at once, then it is dead-lettered)."""
    max_threads: int = Field(8, ge=1)
    """Threads a sync function runs on at once, the scorer's own. When every one is held by a call past
    ``timeout_s`` the reward worker exits with status 1 for its orchestrator to restart it."""


class HttpScorerConfig(_ScorerBase):
    """A remote reward service: ``POST {"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``."""

    type: Literal["http"] = "http"
    """Scorer kind: remote reward services over HTTP."""
    urls: list[str] = Field(min_length=1)
    """Full endpoint URLs (e.g. ``http://rm-0:5000/get_reward``); requests are spread over them. A password in one
    (``http://user:password@host/...``, sent as basic auth) is shown as ``***`` wherever the URL is written.
    Redirects are not followed: a 3xx answer fails its entries, naming where it pointed."""
    load_balancing: Literal["round_robin", "least_loaded"] = "least_loaded"
    """How a request picks its URL; a retry prefers a URL the request has not failed on."""
    batch_size: int = Field(32, ge=1)
    """Samples per request."""
    max_concurrency: int = Field(8, ge=1)
    """Requests in flight at once, over all URLs."""
    timeout_s: float = Field(30.0, gt=0)
    """Total time allowed for one request (s)."""
    max_response_mb: float = Field(16.0, gt=0)
    """Largest answer body read (MiB): a longer one fails the request, not retried (its samples are then scored one
    by one), with a reason naming this limit."""
    max_retries: int = Field(20, ge=0)
    """Extra attempts after a timeout, connection error, HTTP 5xx, 408 or 429 (never other 4xx), at most."""
    retry_timeout_s: float = Field(60.0, gt=0)
    """No retry of a request starts later than this after its first attempt (s): a remote service that
    fails or is down for less is ridden out; past it the request fails and the consumer loop
    delivers its entries again (``consumer.max_deliveries``), then dead-letters them with the reason - except
    when its last attempt could not connect at all: the service is down, and the reward worker pauses its
    intake until a probe is scored (``reward.probe_interval_s``) instead of dead-lettering every entry."""
    backoff_base_s: float = Field(0.5, gt=0)
    """Backoff before retry k is ``min(backoff_max_s, backoff_base_s * 2**k)``, reduced by jitter (s)."""
    backoff_max_s: float = Field(10.0, gt=0)
    """Cap of one backoff (s)."""
    jitter: float = Field(1.0, ge=0, le=1)
    """Fraction of the backoff drawn at random (1 = full jitter: uniform in [0, backoff])."""
    auth_header: str = "Authorization"
    """Header carrying the token."""
    auth_scheme: str = "Bearer"
    """Prefix of the header value (``Bearer <token>``); empty = the raw token."""
    token_env: str | None = None
    """Name of the environment variable holding the token (never the token itself); None = no auth.
    A 401 or 403 answer is not retried: the reward worker pauses its intake, with a reason naming this variable,
    until a probe is accepted (the server given this token again, or the worker restarted with the right one)."""

    @model_validator(mode="after")
    def _check(self) -> HttpScorerConfig:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_base_s ({self.backoff_base_s})")
        for url in self.urls:
            shown = redact_url(url)
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"urls: {shown!r} must start with http:// or https://")
            if self.token_env is not None and shown != url:
                raise ValueError(
                    f"urls: {shown!r} carries a password and token_env is set: one request cannot carry both "
                    "(drop the password from the URL, or token_env)"
                )
        return self


class ModelScorerConfig(_ScorerBase):
    """A local reward model folder (Hugging Face format, safetensors)."""

    type: Literal["model"] = "model"
    """Scorer kind: a reward model loaded in this process."""
    path: str = Field(min_length=1)
    """Model folder: a ``*ForSequenceClassification`` (num_labels=1) or a causal LM with a value head."""
    architecture: Literal["auto", "sequence_classification", "value_head"] = "auto"
    """``auto`` picks ``sequence_classification`` when the config's architectures name one."""
    value_head_prefix: str = "value_head"
    """Weight-name prefix of the value head (``{prefix}.weight``) for ``value_head`` models."""
    input: Literal["text", "token_ids"] = "text"
    """``text``: tokenize prompt + response text with the model's tokenizer; ``token_ids``: use the
    trajectory's token ids as they are (only when the policy and reward model share a tokenizer)."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    timeout_s: float = Field(600.0, gt=0)
    """A micro-batch's forward passes that take longer fail (s). Forwards run one at a time on a thread of the
    scorer's own, which cannot be stopped: when a forward overruns this the reward worker exits with status 1
    (what it holds stays pending) for its orchestrator to restart it, rather than wait on a wedged device."""
    max_length: int = Field(2048, ge=8)
    """Longer inputs are truncated from the left, keeping the end of the response (tokens)."""
    device: str = "cpu"
    """torch device, e.g. ``cpu``, ``cuda``, ``cuda:1``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype."""
    normalize: bool = True
    """Apply ``(r - mean) / std`` with ``mean``/``std`` from the model's config.json when present."""


ScorerConfig = Annotated[
    FunctionScorerConfig | HttpScorerConfig | ModelScorerConfig,
    Field(discriminator="type"),
]


class RewardConfig(BaseConfig):
    """The reward service: scorers combined with weights, fed by a micro-batcher."""

    scorers: list[ScorerConfig] = Field(min_length=1)
    """Scorers run on every trajectory; reward = sum(weight * reward), score = weighted mean of scores."""
    max_batch_size: int = Field(64, ge=1)
    """Trajectories grouped into one scorer call at most."""
    max_wait_ms: float = Field(10.0, ge=0)
    """How long the first trajectory of a micro-batch waits for more (ms)."""
    on_invalid: Literal["dead_letter", "score"] = "dead_letter"
    """A sample whose scorer answer is unusable (NaN, infinite, not a number) - only that sample, never its
    batch: ``dead_letter`` fails it (retried, then dead-lettered with the reason; its group is replaced);
    ``score`` scores it ``invalid_value`` (counted in ``reward/invalid``, the reason logged once per 100)."""
    invalid_value: float | None = Field(None, allow_inf_nan=False)
    """Reward and score of an invalid sample when ``on_invalid = "score"`` (required then, e.g. 0.0)."""
    probe_interval_s: float = Field(5.0, gt=0)
    """While scoring is paused by a permanent error (an HTTP scorer's token refused, its service not reachable
    past ``retry_timeout_s``), how often one held trajectory is scored again to see whether the backend accepts (s);
    the first that is scored resumes intake."""

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        names = [s.name for s in self.scorers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"scorers: names must be unique, repeated: {duplicates}")
        if not any(s.weight > 0 for s in self.scorers):
            raise ValueError("scorers: at least one scorer needs a weight > 0")
        if self.on_invalid == "score" and self.invalid_value is None:
            raise ValueError('on_invalid = "score" needs invalid_value: the reward an invalid sample gets (e.g. 0.0)')
        if self.on_invalid == "dead_letter" and self.invalid_value is not None:
            raise ValueError('invalid_value is used only with on_invalid = "score" (invalid samples are dead-lettered)')
        return self


class ServeRmConfig(BaseConfig):
    """``streamrl serve-rm``: a local reward model behind the OpenRLHF JSON protocol."""

    model_path: str = Field(min_length=1)
    """Reward model folder (see ``ModelScorerConfig.path``)."""
    architecture: Literal["auto", "sequence_classification", "value_head"] = "auto"
    """As ``ModelScorerConfig.architecture``."""
    value_head_prefix: str = "value_head"
    """As ``ModelScorerConfig.value_head_prefix``."""
    host: str = "127.0.0.1"
    """Interface to listen on (``0.0.0.0`` in a container)."""
    port: int = Field(5000, ge=0, le=65535)
    """TCP port; 0 = a free port (printed at start)."""
    token_env: str = "STREAMRL_RM_TOKEN"
    """Environment variable holding the bearer token every request must carry (required)."""
    device: str = "cpu"
    """torch device."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    max_length: int = Field(2048, ge=8)
    """Longer inputs keep their last tokens (tokens)."""
    normalize: bool = True
    """Apply the mean/std stored in the model's config.json."""
    max_batch_size: int = Field(64, ge=1)
    """Queries from concurrent requests grouped into one model call at most."""
    max_wait_ms: float = Field(5.0, ge=0)
    """How long the first query of a micro-batch waits for more (ms)."""
    max_request_samples: int = Field(1024, ge=1)
    """Larger requests are refused with HTTP 413."""
