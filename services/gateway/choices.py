"""Several choices in one OpenAI answer: `n` samples of a prompt, or a batch of prompts.

Each choice is its own Generate call (core batches the calls of one request together) and
answers as choice k at index k: whole answers merge into one, streamed chunks interleave.
OpenAI's order for a batch of prompts with `n` is prompt by prompt, n choices each. Usage
counts each prompt once, however many choices it has, and every choice's completion.
"""

from __future__ import annotations

from typing import Any, TypeVar

from services.gateway.errors import OpenAIError
from services.gateway.openai_schema import MAX_CHOICES

Request = TypeVar("Request")


def one_per_choice(requests: list[Request], n: int) -> list[Request]:
    """`n` copies of each request, choice j seeded `seed + j` where a seed is given, so seeded
    choices differ and stay reproducible (the mapping wraps it to core's uint64). More than
    MAX_CHOICES choices in all are refused."""
    total = len(requests) * n
    if total > MAX_CHOICES:
        raise OpenAIError(
            400, f"n: {total} choices asked for; at most {MAX_CHOICES}", param="n", code="invalid_value"
        )
    if n == 1:
        return requests
    copies = []
    for request in requests:
        seed = request.seed  # type: ignore[attr-defined]
        for j in range(n):
            update = {} if seed is None else {"seed": seed + j}
            copies.append(request.model_copy(update=update))  # type: ignore[attr-defined]
    return copies


def merged_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The answer's usage from its choices' (in choice order, `n` per prompt)."""
    prompt = sum(usage["prompt_tokens"] for usage in usages[::n])
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages[::n])
    completion = sum(usage["completion_tokens"] for usage in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def merged_choices(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One answer from the calls' whole answers in choice order (`n` per prompt)."""
    merged = dict(results[0])
    merged["choices"] = [choice for result in results for choice in result["choices"]]
    merged["usage"] = merged_usage([result["usage"] for result in results], n)
    return merged
