"""The decode of one batch's running sequences (mlx-lm's `GenerationBatch`), with drafted tokens verified in the same
forward: each row feeds its pending token and its draft, so one expert call per worker per layer
checks every row's draft, and a row gains up to 1 + K tokens per step.

It keeps mlx-lm's `GenerationBatch` state as `GenerationBatch._step` leaves it (the token to feed
next, the tokens in the KV cache in `tokens`: services/common/mlx_lm_adapter.DecodeState), so a
step without drafts is mlx-lm's own `next()`, and the two kinds of step mix freely.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.sample_utils import greedy_sampler

from services.common.mlx_lm_adapter import DecodeState
from services.core.sampling import FilteredSampler
from services.core.speculative.acceptance import accept_greedy, accept_one, accept_sampled, sample_one
from services.core.speculative.config import SpeculativeConfig
from services.core.speculative.metrics import SpeculativeCounters
from services.core.speculative.mtp import MtpDrafter
from services.core.speculative.mtp_prefix import MtpPrefixState
from services.core.speculative.ngram import NgramDrafter, NgramIndex
from services.core.speculative.policy import DraftPolicy, StepCosts
from services.core.speculative.recurrent_rows import RecurrentRows
from services.core.speculative.row_trim import RowOrder, can_trim_rows, trim_rows

Response = GenerationBatch.Response


def make_drafter(config: SpeculativeConfig, tokenizer, model):
    """What drafts for `config`: prompt lookup, or the draft model (loaded now, checked against
    the served model's tokenizer). The served model's caches must drop rejected tokens: see
    recurrent_rows(), which the engine calls first."""
    vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
    if config.method == "mtp":
        layer = getattr(model, "mtp_draft", None)
        if layer is None:
            raise ValueError("--speculative mtp: the model was loaded without its MTP layer")
        return MtpDrafter(model, layer, vocab_size)
    if config.draft_model is None:
        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    from services.core.speculative.draft_model import load_draft_model

    return load_draft_model(config.draft_model, tokenizer, vocab_size)


class SpeculativeDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        counters: SpeculativeCounters,
        wants: Callable[[int], bool] = lambda uid: True,
        drafter=None,
        costs: StepCosts | None = None,
        recurrent: RecurrentRows | None = None,
    ):
        """`wants(uid)`: whether that sequence's request allows speculation; `drafter.index()`
        makes each sequence's `propose(context, k)` (default: prompt lookup). `costs`: what a drafted
        token costs, measured from the steps (policy.StepCosts); the engine keeps it across batches,
        which end whenever it idles. `recurrent`: the model's recurrent layers, replayed after
        each verify so they keep only accepted positions (recurrent_rows.py)."""
        self.config = config
        self.counters = counters
        self.wants = wants
        self.order = RowOrder()
        self._drafter = drafter or NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
        self._rows: dict[int, tuple[NgramIndex, DraftPolicy]] = {}
        # MTP drafts from the hidden states each forward leaves (prefill, decode, verify): `feed`
        self._wants_hidden = getattr(self._drafter, "wants_hidden", False)
        self.prefill_sink = self.prefilled if self._wants_hidden else None  # for BatchStep
        self._prefilling: dict[int, object] = {}  # uid -> its MTP state, before it decodes
        self.costs = costs or StepCosts(config.draft_cost)
        self.recurrent = recurrent

    def decode(self, batch: GenerationBatch) -> list[Response]:
        """One decode step of `batch`: GenerationBatch.next()'s responses, several per row when
        its draft was accepted, in the order the row emits them."""
        if not batch.uids:
            return []
        self._forget(batch.uids)
        if not can_trim_rows(batch.prompt_cache, self.recurrent):
            return [self._in_token_order(r) for r in batch.next()]
        pending = DecodeState(batch).next_tokens.tolist()  # the step before has finished now
        self.costs.began(time.perf_counter())
        drafts = self._drafts(batch, pending)
        self.costs.chose(max(len(d) for d in drafts))
        if not any(drafts):
            uids = list(batch.uids)
            responses = [self._in_token_order(r) for r in batch.next()]
            if self._wants_hidden:  # the forward's states at the pending tokens, for MTP to feed on
                hidden = self._drafter.last_hidden()
                for i, uid in enumerate(uids):
                    if self.wants(uid):
                        self._rows[uid][0].feed(hidden[i : i + 1, :1], pending[i : i + 1])
        else:
            responses = self._verify(batch, pending, drafts)
        if not batch.uids:  # every row finished: the next step is not this one's sequel
            self.costs.idle()
        return responses

    def in_token_order(self, uid: int, cache: list) -> list:
        """A cache taken out of the batch (a finished or removed row) with its tokens in order."""
        return self.order.in_token_order(uid, cache)

    def prefilled(self, uids: list[int], chunks: list[list[int]]) -> None:
        """Right after a prompt forward (a prefill chunk, or the last prompt tokens): row r of the
        hidden states it left [B, L, H] holds those at `chunks[r]`, for an MTP drafter to feed on."""
        hidden = self._drafter.last_hidden()
        for row, (uid, chunk) in enumerate(zip(uids, chunks, strict=True)):
            if not self.wants(uid):  # a request that never drafts leaves the MTP layer idle
                continue
            if uid not in self._prefilling:
                self._prefilling[uid] = self._drafter.index()
            self._prefilling[uid].feed(hidden[row : row + 1, : len(chunk)], chunk)

    def start(self, uid: int, cached: int, kept: MtpPrefixState | None = None) -> None:
        """A sequence joined the batch holding its prompt's first `cached` positions from the prefix
        cache, and the MTP state kept with them, if any (mtp_prefix.py)."""
        if self._wants_hidden:
            self._prefilling[uid] = (
                self._drafter.index(cached) if kept is None else self._drafter.resume(kept)
            )

    def kept(self, uid: int, positions: int) -> MtpPrefixState | None:
        """The MTP state to keep beside a prefix-cache entry of the sequence's first `positions`."""
        index = self._rows[uid][0] if uid in self._rows else self._prefilling.get(uid)
        return index.kept(positions) if self._wants_hidden and index is not None else None

    def forget(self, uid: int) -> None:
        """A sequence left its batch (finished, cancelled, or moved to the prefix cache)."""
        self._rows.pop(uid, None)
        self._prefilling.pop(uid, None)

    def _forget(self, uids: list[int]) -> None:
        live = set(uids)
        for uid in [u for u in self._rows if u not in live]:
            del self._rows[uid]
        self.order.forget(live)

    def _drafts(self, batch: GenerationBatch, pending: list[int]) -> list[list[int]]:
        drafts, emitted = [], DecodeState(batch).emitted
        plain = self.costs.wants_plain()  # a step to price drafting against
        for i, uid in enumerate(batch.uids):
            if uid not in self._rows:  # a draft model's index holds a KV cache: made once per sequence
                index = self._prefilling.pop(uid, None) or self._drafter.index()
                self._rows[uid] = (index, DraftPolicy(self.config.num_speculative_tokens))
            index, policy = self._rows[uid]
            left = batch.max_tokens[i] - emitted[i] - 1  # the pending token is one
            sampler = batch.samplers[i]
            drafting = (
                not plain
                and left > 0
                and (sampler is greedy_sampler or isinstance(sampler, FilteredSampler))
                and self.wants(uid)
            )
            k = min(policy.budget(self.costs), left) if drafting else 0
            drafts.append(index.propose(batch.tokens[i] + [pending[i]], k) if k else [])
        on_device = [d for d in drafts if isinstance(d, mx.array)]  # a draft model's: one sync for all
        if self._wants_hidden:  # the MTP caches fed since the last step
            on_device.extend(a for index, _ in self._rows.values() for a in index.state())
        if on_device:
            mx.eval(on_device)
        return [d.tolist() if isinstance(d, mx.array) else d for d in drafts]

    def _verify(self, batch: GenerationBatch, pending: list[int], drafts: list[list[int]]) -> list[Response]:
        state = DecodeState(batch)
        dtype = state.next_tokens.dtype
        width = 1 + max(len(d) for d in drafts)
        rows = [[p, *d] + [p] * (width - 1 - len(d)) for p, d in zip(pending, drafts, strict=True)]
        if self.recurrent is not None:
            self.recurrent.arm(batch.prompt_cache)
        logits = batch.model(mx.array(rows, dtype=dtype), cache=batch.prompt_cache)
        hidden = self._drafter.last_hidden() if self._wants_hidden else None  # [B, width, H]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.argmax(logprobs, axis=-1)
        mx.eval(logprobs, targets)
        targets = targets.tolist()

        emitted: list[list[tuple[int, mx.array]]] = []
        reasons: list[str | None] = []
        following: list[int] = []
        drop = []
        for i, (uid, draft) in enumerate(zip(batch.uids, drafts, strict=True)):
            if batch.logits_processors[i]:
                kept, token, processed = _verify_processed(batch, i, pending[i], draft, logits[i])
                scores = [row[0] for row in processed]  # [vocab] each, as GenerationBatch keeps them
            else:
                kept, token = self._accept(batch.samplers[i], draft, targets[i], logprobs[i])
                scores = [logprobs[i, j] for j in range(kept + 1)]
            if draft:
                self._rows[uid][1].observe(len(draft), kept)
                self.counters.record(len(draft), kept)
            if hidden is not None and self.wants(uid):  # the positions this step confirmed, and their tokens
                self._rows[uid][0].feed(hidden[i : i + 1, : kept + 1], [pending[i], *draft[:kept]])
            row = [(pending[i], state.next_logprobs[i])] + [(draft[j], scores[j]) for j in range(kept)]
            row, reason = _until_finished(batch, i, row)
            batch.tokens[i].extend(t for t, _ in row)
            emitted.append(row)
            reasons.append(reason)
            following.append((token, scores[kept]))
            drop.append(width - len(row))
        trim_rows(batch.prompt_cache, drop, batch.uids, self.order, self.recurrent)

        state.advance(
            mx.array(pending, dtype=dtype),
            state.next_logprobs,
            mx.array([t for t, _ in following], dtype=dtype),
            [lp for _, lp in following],
        )

        responses, keep = [], []
        for i, (uid, row, reason) in enumerate(zip(batch.uids, emitted, reasons, strict=True)):
            for token, lp in row[:-1]:
                responses.append(Response(uid, token, lp, None, None, None))
            token, lp = row[-1]
            if reason is None:
                keep.append(i)
                responses.append(Response(uid, token, lp, None, None, None))
            else:
                cache = self.order.in_token_order(uid, batch.extract_cache(i))
                responses.append(Response(uid, token, lp, reason, cache, batch.tokens[i]))
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return responses

    @staticmethod
    def _accept(sampler, draft: list[int], targets: list[int], logprobs: mx.array) -> tuple[int, int]:
        if sampler is greedy_sampler:
            return accept_greedy(draft, targets)
        if isinstance(sampler, FilteredSampler):
            return accept_sampled(draft, logprobs, sampler)
        return 0, int(sampler(logprobs[:1]).item())  # a sampler we cannot reason about: no drafts

    def _in_token_order(self, response: Response) -> Response:
        if response.prompt_cache is not None:
            response.prompt_cache = self.order.in_token_order(response.uid, response.prompt_cache)
        return response


def _verify_processed(
    batch: GenerationBatch, i: int, pending: int, draft: list[int], logits: mx.array
) -> tuple[int, int, list[mx.array]]:
    """Row i's draft checked one position at a time, as GenerationBatch._step would process each
    token: its logits processors (penalties, logit_bias, a grammar) see the context with every
    kept token and never a rejected one, so a grammar's state stays that of the emitted text.
    -> (drafts kept, next token, the processed logprobs [1, vocab] of positions 0..kept)."""
    state = DecodeState(batch)
    processors = batch.logits_processors[i]
    context_buffer = state.token_context[i]
    sampler = batch.samplers[i]
    dtype = state.next_tokens.dtype

    def processed(position: int, fed: int) -> mx.array:
        context = context_buffer.update_and_fetch(mx.array([fed], dtype=dtype))
        row = logits[position : position + 1]
        for processor in processors:
            row = processor(context, row)
        return row - mx.logsumexp(row, axis=-1, keepdims=True)

    scores = [processed(0, pending)]
    for j, token in enumerate(draft):
        kept, instead = accept_one(sampler, token, scores[j])
        if not kept:
            return j, instead, scores
        scores.append(processed(j + 1, token))
    return len(draft), sample_one(sampler, scores[-1]), scores


def _until_finished(batch: GenerationBatch, i: int, row: list) -> tuple[list, str | None]:
    """The tokens row i emits, cut at the first that ends it (max_tokens or a stop)."""
    state = DecodeState(batch)
    for n, (token, _) in enumerate(row, start=1):
        state.emitted[i] += 1
        reason = "length" if state.emitted[i] >= batch.max_tokens[i] else None
        if state.stop_matchers[i].advance(token):
            reason = "stop"
        if reason is not None:
            return row[:n], reason
    return row, None
