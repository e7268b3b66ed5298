"""Which drafted tokens a row keeps, and the token after them.

Greedy rows keep drafts while each equals the target's argmax. Sampling rows use speculative
rejection sampling for a deterministic draft (the draft distribution is one-hot): draft d is
kept with probability p(d); on rejection the token comes from p with d removed, renormalised.
Every emitted token is then distributed exactly as p, the distribution the request's sampler
draws from (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

import mlx.core as mx

from services.core.sampling import FilteredSampler


def accept_greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """`targets[j]`: the argmax after the row's j-th input. -> (drafts kept, next token)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return kept, targets[kept]


def accept_sampled(drafts: list[int], logprobs: mx.array, sampler: FilteredSampler) -> tuple[int, int]:
    """`logprobs` [len(drafts) + 1, vocab]: the model's, after the row's inputs."""
    target = sampler.target_logprobs(logprobs[: len(drafts) + 1])
    probs = mx.exp(target[mx.arange(len(drafts)), mx.array(drafts)]).tolist() if drafts else []
    for j, draft in enumerate(drafts):
        instead = _keep_or_resample(sampler, target[j], draft, probs[j])
        if instead is not None:
            return j, instead
    return len(drafts), int(sampler.categorical(target[len(drafts)]).item())


def _keep_or_resample(sampler: FilteredSampler, target: mx.array, draft: int, p: float) -> int | None:
    """None: the draft is kept (with probability p(d)); else the token drawn from p without d."""
    if sampler.uniform() < p or p >= 1.0 - 1e-6:  # p(d) ~ 1: no residual left
        return None
    return int(sampler.categorical(target.at[draft].add(-mx.inf)).item())


def accept_one(sampler, draft: int, logprobs: mx.array) -> tuple[bool, int | None]:
    """One position's check, for rows whose logits processors must see each kept token before
    the next position is processed. `logprobs` [1, vocab], processed. -> (kept, token if not)."""
    if isinstance(sampler, FilteredSampler):
        target = sampler.target_logprobs(logprobs)[0]
        instead = _keep_or_resample(sampler, target, draft, mx.exp(target[draft]).item())
        return instead is None, instead
    best = int(mx.argmax(logprobs[0]).item())  # greedy
    return (True, None) if best == draft else (False, best)


def sample_one(sampler, logprobs: mx.array) -> int:
    if isinstance(sampler, FilteredSampler):
        return int(sampler.categorical(sampler.target_logprobs(logprobs)[0]).item())
    return int(mx.argmax(logprobs[0]).item())
