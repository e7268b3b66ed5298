"""Several choices in one OpenAI answer: `n` samples of a prompt, or a batch of prompts.

Each choice is its own Generate call (core batches the calls of one request together); the
calls' whole answers merge into one, choice k at index k. OpenAI's order for a batch of prompts
with `n` is prompt by prompt, n choices each. Usage counts each prompt once, however many
choices it has, and every choice's completion.
"""

from __future__ import annotations

from typing import Any, TypeVar

from services.gateway.errors import OpenAIError
from services.gateway.openai_schema import UINT64_MAX

MAX_CHOICES = 256
Request = TypeVar("Request")


def one_per_choice(requests: list[Request], n: int, stream: bool) -> list[Request]:
    """`n` copies of each request, choice j seeded `seed + j` where a seed is given, so seeded
    choices differ and stay reproducible. Refused: more than MAX_CHOICES choices, and several
    streamed (their chunks would interleave)."""
    total = len(requests) * n
    if total > MAX_CHOICES:
        raise OpenAIError(
            400, f"n: {total} choices asked for; at most {MAX_CHOICES}", param="n", code="invalid_value"
        )
    if total > 1 and stream:
        param = "n" if n > 1 else "stream"
        raise OpenAIError(
            400,
            f"{param}: {total} choices are answered whole; send stream false, or one prompt with n 1 to stream",
            param=param,
            code="invalid_value",
        )
    if n == 1:
        return requests
    copies = []
    for request in requests:
        seed = request.seed  # type: ignore[attr-defined]
        for j in range(n):
            update = {} if seed is None else {"seed": (seed + j) & UINT64_MAX}
            copies.append(request.model_copy(update=update))  # type: ignore[attr-defined]
    return copies


def merged_choices(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One answer from the calls' answers in choice order (`n` per prompt)."""
    merged = dict(results[0])
    merged["choices"] = [
        {**choice, "index": index} for index, result in enumerate(results) for choice in result["choices"]
    ]
    prompt = sum(result["usage"]["prompt_tokens"] for result in results[::n])
    cached = sum(result["usage"]["prompt_tokens_details"]["cached_tokens"] for result in results[::n])
    completion = sum(result["usage"]["completion_tokens"] for result in results)
    merged["usage"] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return merged
