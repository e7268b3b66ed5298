"""Per-request samplers and logits processors (mlx-lm's filters, with per-request seeds).

mlx-lm's samplers draw from MLX's global random state; a request with a seed gets
its own key chain instead, so its tokens do not depend on what else is running.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_logits_processors

from services.proto.moemesh.v1 import core_pb2

Sampler = Callable[[mx.array], mx.array]
DEFAULT_TEMPERATURE = 1.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # 1 is off; refuses NaN too


class SamplingError(ValueError):
    pass


def make_sampler(params: core_pb2.SamplingParams, vocab_size: int) -> Sampler:
    temperature = params.temperature if params.HasField("temperature") else DEFAULT_TEMPERATURE
    if not 0 <= temperature < math.inf:  # also refuses NaN, which would sample garbage
        raise SamplingError(f"temperature must be a finite number >= 0, got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise SamplingError("top_p must be in (0, 1]")
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k < 0:
        raise SamplingError("top_k must be >= 0 (0 disables it)")
    min_p = params.min_p if params.HasField("min_p") else 0.0
    if not 0 <= min_p <= 1:
        raise SamplingError("min_p must be in [0, 1]")
    if temperature == 0:
        return greedy_sampler

    filters = []
    if top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if 0 < top_k < vocab_size:
        filters.append(lambda x: apply_top_k(x, top_k))
    return FilteredSampler(temperature, filters, params.seed if params.HasField("seed") else None)


class FilteredSampler:
    """Temperature sampling after mlx-lm's filters. Speculative decoding reads the same target
    distribution (`target_logprobs`) and draws from the same key chain (`uniform`, `categorical`),
    so a seeded request stays reproducible with speculation on."""

    def __init__(self, temperature: float, filters: list, seed: int | None):
        self.temperature = temperature
        self.filters = filters
        self._key = None if seed is None else mx.random.key(seed)

    def _subkey(self):
        if self._key is None:
            return None
        self._key, subkey = mx.random.split(self._key)
        return subkey

    def _scaled(self, logprobs: mx.array) -> mx.array:
        for apply in self.filters:
            logprobs = apply(logprobs)
        return logprobs * (1.0 / self.temperature)

    def target_logprobs(self, logprobs: mx.array) -> mx.array:
        """The log-distribution this sampler draws from: filtered, scaled, normalised."""
        scaled = self._scaled(logprobs)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    def categorical(self, scaled: mx.array) -> mx.array:
        return mx.random.categorical(scaled, key=self._subkey())

    def uniform(self) -> float:
        return mx.random.uniform(key=self._subkey()).item()

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.categorical(self._scaled(logprobs))


MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0


def make_processors(params: core_pb2.SamplingParams, vocab_size: int) -> list:
    """Penalties as mlx-lm implements them, then logit_bias (added after, as OpenAI's is)."""
    processors = _penalty_processors(params)
    if params.logit_bias:
        processors.append(logit_bias_processor(dict(params.logit_bias), vocab_size))
    return processors


def logit_bias_processor(bias: dict[int, float], vocab_size: int):
    """token id -> value added to its logit; -100 bans a token, +100 all but forces it."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for token, value in bias.items():
        if token >= vocab_size:
            raise SamplingError(f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # also refuses NaN
            raise SamplingError(f"logit_bias: the bias for token {token} must be in [-100, 100], got {value}")
    ids = mx.array(sorted(bias), dtype=mx.int32)
    values = mx.array([bias[t] for t in sorted(bias)], dtype=mx.float32)

    def add_bias(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[..., ids].add(values.astype(logits.dtype))

    return add_bias


def _penalty_processors(params: core_pb2.SamplingParams) -> list:
    def value(name: str):
        return getattr(params, name) if params.HasField(name) else None

    repetition = value("repetition_penalty")
    # mlx-lm divides the seen tokens' positive logits by it: beyond these bounds they overflow
    if (
        repetition is not None
        and not REPETITION_PENALTY_RANGE[0] <= repetition <= REPETITION_PENALTY_RANGE[1]
    ):
        raise SamplingError(
            f"repetition_penalty must be in {list(REPETITION_PENALTY_RANGE)}, got {repetition}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        penalty = value(name)
        if penalty is not None and not -2 <= penalty <= 2:
            raise SamplingError(f"{name} must be in [-2, 2]")
    return make_logits_processors(
        repetition_penalty=repetition if repetition not in (None, 1.0) else None,
        presence_penalty=value("presence_penalty"),
        frequency_penalty=value("frequency_penalty"),
    )
