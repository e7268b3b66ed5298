"""`--speculative METHOD --num-speculative-tokens K`, or vLLM's `--speculative-config JSON`."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft:PATH", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # what a drafted token costs, in plain decode steps (drafting it and verifying its position);
    # None: measured from the steps (policy.StepCosts). A moe-mesh key of --speculative-config.
    draft_cost: float | None = None

    @property
    def draft_model(self) -> str | None:
        """The draft model's path, for `draft:PATH`."""
        name, _, path = self.method.partition(":")
        return path if name == "draft" else None

    def __post_init__(self):
        name, _, path = self.method.partition(":")
        if not (self.method in ("ngram", "mtp") or (name == "draft" and path)):
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")
        if self.draft_cost is not None and not 0 <= self.draft_cost <= 100:
            raise ValueError("draft_cost must be a number of plain steps in [0, 100]")


_JSON_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_cost",
}


def speculative_config(
    method: str | None, num_tokens: int | None, config_json: str | None
) -> SpeculativeConfig | None:
    """The flags as one config; None when speculation is off. The JSON names vLLM's keys; a
    flag given beside it wins."""
    fields: dict = {}
    if config_json:
        try:
            given = json.loads(config_json)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(given, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = set(given) - _JSON_KEYS
        if unknown:
            raise ValueError(
                f"--speculative-config: unsupported keys {sorted(unknown)}; known: {sorted(_JSON_KEYS)}"
            )
        for key, value in given.items():
            if key in ("method", "model") and not isinstance(value, str):
                raise ValueError(f"--speculative-config: {key} must be a string")
            if key == "draft_cost":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise ValueError("--speculative-config: draft_cost must be a number")
            elif key not in ("method", "model") and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        model = given.pop("model", None)
        if model is not None:  # vLLM names a draft model by `model` (method "draft_model" or none)
            if given.get("method", "draft_model") != "draft_model":
                raise ValueError("--speculative-config: `model` goes with method draft_model")
            given["method"] = f"draft:{model}"
        elif given.get("method") == "draft_model":
            raise ValueError("--speculative-config: method draft_model needs `model`")
        fields.update(given)
    if method:
        fields["method"] = method
    if num_tokens is not None:
        fields["num_speculative_tokens"] = num_tokens
    if not fields:
        return None
    if "method" not in fields:
        raise ValueError("speculative decoding needs a method: --speculative ngram")
    return SpeculativeConfig(**fields)
