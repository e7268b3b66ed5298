"""Pydantic model for the OpenAI (legacy) Completions request body, `POST /v1/completions`.

Contract: `prompt` is a string or a list of token ids, or a list of up to `MAX_CHOICES` of either
(evaluation harnesses send batches): each prompt is its own sequence in core, answered as
`choices[i]` for prompt i (choices.py). `best_of` > 1 and `suffix` are
refused with a 400 naming the field: core samples one sequence per prompt and has no
fill-in-the-middle template. `max_tokens` defaults to 16, as OpenAI's and vLLM's do.

`echo` with `logprobs` also scores the prompt (the logprob of each prompt token given the ones
before it, the first `null`), as OpenAI's completions did and vLLM's do: evaluation harnesses
score texts this way (lm-evaluation-harness's `local-completions`: echo, logprobs 1, max_tokens 1).
With `echo`, `max_tokens` may be 0 (OpenAI's older form): the prompt, scored, is the whole answer.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, field_validator

from services.gateway.errors import OpenAIError
from services.gateway.openai_schema import MAX_CHOICES, UINT32_MAX, GenerationOptions

TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 20


class CompletionRequest(GenerationOptions):
    """`POST /v1/completions` body."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: StrictBool = False
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_CHOICES:
                raise ValueError(f"{len(prompt)} prompts given; at most {MAX_CHOICES} per request")
            if any(len(one) == 0 for one in prompt):
                raise ValueError("prompt must not be empty")
            return prompt[0] if len(prompt) == 1 else prompt
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch it sent."""
        prompt = self.prompt
        several = isinstance(prompt, list) and isinstance(prompt[0], str | list)
        return list(prompt) if several else [prompt]  # type: ignore[list-item]

    def one_per_prompt(self) -> list[CompletionRequest]:
        """This request once per prompt."""
        prompts = self.prompts()
        return [self] if len(prompts) == 1 else [self.model_copy(update={"prompt": p}) for p in prompts]

    def check_max_tokens(self) -> None:
        """0 only with echo (pydantic checks each field alone, and echo is validated after it)."""
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                400,
                "max_tokens: must be at least 1 (0 only with echo, to return the prompt scored)",
                param="max_tokens",
                code="invalid_value",
            )

    def scores_prompt(self) -> bool:
        """The answer carries the prompt's own logprobs (echo with logprobs, or nothing generated)."""
        return self.echo and (self.logprobs is not None or self.max_tokens == 0)

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"best_of={best_of} is not supported: this server generates one sequence")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        return suffix

    def prompt_text(self) -> str | None:
        """The prompt when it is text; None when it is token ids."""
        return self.prompt if isinstance(self.prompt, str) else None

    def prompt_token_ids(self) -> list[int]:
        if isinstance(self.prompt, str):
            raise TypeError("the prompt is text, not token ids")
        return [int(token) for token in self.prompt]  # type: ignore[arg-type]
