"""Drafting with the checkpoint's own multi-token-prediction layer (`--speculative mtp`).

An MTP layer predicts the token after next from the main model's hidden state at a position
(after the final norm, as the checkpoint was trained) and the embedding of the token that follows
it: `eh_proj([enorm(embed(t+1)); hnorm(h_t)])` through one decoder layer of the model's own kind,
then `shared_head.norm` and the main model's output head. Drafts beyond the first feed the layer its
own normed output and its last draft (as vLLM and SGLang chain it).

Each sequence keeps the layer's KV cache over its own positions, fed from every forward of the main
model that computes them (prefill chunks, plain decode steps, the confirmed part of each verify);
drafted positions beyond them are cut off at the next run. A greedy draft is a deterministic function
of the context, so verification stays exact (acceptance.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from services.common.model_shape import text_config
from services.core.speculative.mtp_prefix import MtpPrefixState
from services.core.speculative.mtp_weights import MTP_FILE, mtp_block_index, unsupported_reason


class MtpLayer(nn.Module):
    def __init__(self, decoder_layer: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = decoder_layer
        self.shared_head = {"norm": nn.RMSNorm(hidden_size, eps=eps)}

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """embedded, hidden [1, L, H] -> the normed output [1, L, H] (the output head's input)."""
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return self.shared_head["norm"](self.block(x, mask, cache))


class HiddenRecorder(nn.Module):
    """Stands in for the model's output head and keeps its last input: the final hidden states of
    the forward that just ran, read by the caller right after that forward returns."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.hidden: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        self.hidden = x
        return self.head(x)


def check_mtp_servable(split_dir: Path, config: dict) -> Path:
    """The split's MTP weights file; ValueError saying why `--speculative mtp` cannot serve it."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"--speculative mtp: {reason}")
    path = Path(split_dir) / "core" / MTP_FILE
    if not path.exists():
        raise ValueError(
            f"--speculative mtp: {path} is missing: the split was made from files without MTP weights "
            "(mlx-lm's conversions drop them) or by an older moe-mesh; split the original Hugging Face "
            "checkpoint (split keeps its MTP layers in core)"
        )
    return path


def load_mtp(model, split_dir: Path, config: dict) -> MtpLayer:
    """The checkpoint's first MTP layer, weights from `split_dir/core/mtp.safetensors`, quantized as
    they are stored. Installs a HiddenRecorder as the model's output head. Raises ValueError."""
    path = check_mtp_servable(split_dir, config)
    text = text_model(model)
    if not isinstance(getattr(text, "lm_head", None), nn.Module):
        raise ValueError("--speculative mtp: the model ties its output head to its embedding")
    if getattr(text, "args", None) is None:
        raise ValueError("--speculative mtp: the model keeps no ModelArgs to build its MTP layer from")
    weights = {k.removeprefix("mtp.0."): v for k, v in mx.load(str(path)).items() if k.startswith("mtp.0.")}
    block = type(text.model.layers[-1])(text.args, mtp_block_index(config))
    hidden = text_config(config)
    layer = MtpLayer(block, int(hidden["hidden_size"]), float(hidden.get("rms_norm_eps", 1e-6)))
    own = ("enorm", "hnorm", "eh_proj", "shared_head")
    renamed = {(k if k.split(".")[0] in own else f"block.{k}"): v for k, v in weights.items()}
    quantization = config.get("quantization")
    if quantization and any(k.endswith(".scales") for k in renamed):
        nn.quantize(
            layer,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in renamed,
        )
    try:
        layer.load_weights(list(renamed.items()), strict=True)
    except ValueError as error:
        raise ValueError(f"--speculative mtp: {path} does not fit the model's MTP layer: {error}") from None
    layer.eval()
    mx.eval(layer.parameters())
    if not isinstance(text.lm_head, HiddenRecorder):
        text.lm_head = HiddenRecorder(text.lm_head)
    return layer


def text_model(model) -> nn.Module:
    """The language model: the model itself, or the one a multimodal wrapper holds."""
    return getattr(model, "language_model", model)


class MtpDrafter:
    """What `--speculative mtp` drafts with: the MTP layer, the main model's embedding and head."""

    wants_hidden = True

    def __init__(self, model, layer: MtpLayer, vocab_size: int | None):
        self.recorder: HiddenRecorder = text_model(model).lm_head
        self.embed = model.model.embed_tokens
        self.layer = layer
        self.vocab_size = vocab_size

    def index(self, origin: int = 0) -> MtpSequence:
        """A new sequence's state; `origin`: the prompt positions it starts past (a prefix-cache
        hit that kept no MTP state), whose hidden states the layer never sees."""
        return MtpSequence(self, origin)

    def resume(self, kept: MtpPrefixState) -> MtpSequence:
        """A sequence starting from a prefix-cache entry that kept the layer's state (mtp_prefix.py)."""
        sequence = MtpSequence(self, 0)
        sequence.cache.state = (kept.keys, kept.values, kept.slots)
        sequence.confirmed = kept.slots
        sequence.dangling = kept.dangling
        return sequence

    def last_hidden(self) -> mx.array:
        """[B, W, H]: the final hidden states of the forward that just returned."""
        return self.recorder.hidden

    def draft_token(self, out: mx.array) -> mx.array:
        logits = self.recorder.head(out)[0, -1]
        return mx.argmax(logits[: self.vocab_size] if self.vocab_size else logits)


class MtpSequence:
    """One sequence's MTP state, fed in token order. `feed(hidden, tokens)` after each forward of the
    main model over the sequence (prefill chunks, the last prompt token, each verify's confirmed
    positions): the hidden states at those positions and the tokens fed at them. Each position's
    hidden state pairs with the token after it, so the last one waits (`dangling`) for the next
    feed or for `propose(context, k)`, whose context ends with the token that follows it."""

    def __init__(self, drafter: MtpDrafter, origin: int = 0):
        self.drafter = drafter
        self.origin = origin  # the sequence position of the cache's first slot
        self.cache = KVCache()
        self.confirmed = 0  # positions in `cache` that are the sequence's own (not drafts)
        self.dangling: mx.array | None = None  # [1, 1, H]: the last position, its next token unknown
        self._base: mx.array | None = None  # the layer's output at the last confirmed position

    def feed(self, hidden: mx.array, tokens: list[int]) -> None:
        """hidden [1, m, H] at the positions whose input tokens are `tokens` [m]."""
        if self.dangling is not None:
            pairs, following = mx.concatenate([self.dangling, hidden[:, :-1]], axis=1), tokens
        else:  # the sequence's first position, or one whose predecessor was never seen
            pairs, following = hidden[:, :-1], tokens[1:]
        self.dangling = hidden[:, -1:]
        if following:
            self._run(pairs, following)

    def propose(self, context: list[int], k: int) -> mx.array | list[int]:
        """k drafts after `context` (a lazy [k] array), or none before the sequence was fed."""
        if k <= 0:
            return []
        if self.dangling is not None:  # the pending token is the context's last: certain
            self._run(self.dangling, context[-1:])
            self.dangling = None
        if self._base is None:
            return []
        out = self._base
        token = self.drafter.draft_token(out)
        drafts = [token]
        for _ in range(k - 1):  # chained: beyond the confirmed positions, cut off at the next run
            out = self.drafter.layer(self.drafter.embed(token.reshape(1, 1)), out, self.cache)
            token = self.drafter.draft_token(out)
            drafts.append(token)
        return mx.stack(drafts)

    def _run(self, hidden: mx.array, following: list[int]) -> None:
        if self.cache.offset > self.confirmed:
            self.cache.trim(self.cache.offset - self.confirmed)
        out = self.drafter.layer(self.drafter.embed(mx.array([following])), hidden, self.cache)
        self.confirmed += len(following)
        self._base = out[:, -1:]

    def kept(self, positions: int) -> MtpPrefixState | None:
        """The state to keep beside a prefix-cache entry of the sequence's first `positions`
        positions: their slots but the last, and the last one's hidden state while it dangles.
        None where the layer has not seen them all from the first."""
        slots = positions - 1
        if self.origin != 0 or slots < 1 or self.confirmed < slots:
            return None
        dangling = self.dangling if self.confirmed == slots else None
        keys, values = (mx.contiguous(a[..., :slots, :]) for a in (self.cache.keys, self.cache.values))
        return MtpPrefixState(keys, values, dangling)

    def state(self) -> list[mx.array]:
        """What to evaluate with the step's drafts, so the cache never holds a growing graph."""
        if self._base is None:
            return []
        return [self._base, *(a for a in (self.cache.keys, self.cache.values) if a is not None)]
