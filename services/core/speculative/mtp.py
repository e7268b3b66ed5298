"""Drafting with the checkpoint's own multi-token-prediction layer (`--speculative mtp`).

An MTP layer predicts the token after next from the main model's hidden state at a position
(after the final norm, as the checkpoint was trained) and the embedding of the token that follows
it: `eh_proj([enorm(embed(t+1)); hnorm(h_t)])` through one decoder layer of the model's own kind,
then `shared_head.norm` and the main model's output head. Drafts beyond the first feed the layer its
own normed output and its last draft (as vLLM and SGLang chain it).

Each sequence keeps the layer's KV cache for the positions its verify forwards confirmed; the
drafted positions beyond them are cut off at the next step. A greedy draft is a deterministic
function of the context, so verification stays exact (acceptance.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from services.core.speculative.mtp_weights import MTP_FILE, text_config, unsupported_reason


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


def _inner_model(model) -> nn.Module:
    inner = getattr(model, "language_model", model)
    return inner.model


def check_mtp_servable(split_dir: Path, config: dict) -> Path:
    """The split's MTP weights file; ValueError saying why `--speculative mtp` cannot serve it."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"--speculative mtp: {reason}")
    path = Path(split_dir) / "core" / MTP_FILE
    if not path.exists():
        raise ValueError(
            f"--speculative mtp: {path} is missing; split the original checkpoint again "
            "(split keeps its MTP layers in core)"
        )
    return path


def load_mtp(model, split_dir: Path, config: dict) -> MtpLayer:
    """The checkpoint's first MTP layer, weights from `split_dir/core/mtp.safetensors`, quantized as
    they are stored. Installs a HiddenRecorder as the model's output head. Raises ValueError."""
    path = check_mtp_servable(split_dir, config)
    holder = getattr(model, "language_model", model)
    if not isinstance(getattr(holder, "lm_head", None), nn.Module):
        raise ValueError("--speculative mtp: the model ties its output head to its embedding")
    weights = {k.removeprefix("mtp.0."): v for k, v in mx.load(str(path)).items() if k.startswith("mtp.0.")}
    text = text_config(config)
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args
    layers = _inner_model(model).layers
    if args is None:
        raise ValueError("--speculative mtp: the model keeps no ModelArgs to build its MTP layer from")
    block = type(layers[-1])(args, int(text["num_hidden_layers"]))
    layer = MtpLayer(block, int(text["hidden_size"]), float(text.get("rms_norm_eps", 1e-6)))
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
    layer.load_weights(list(renamed.items()), strict=True)
    layer.eval()
    mx.eval(layer.parameters())
    if not isinstance(holder.lm_head, HiddenRecorder):
        holder.lm_head = HiddenRecorder(holder.lm_head)
    return layer


class MtpDrafter:
    """What `--speculative mtp` drafts with: the MTP layer, the main model's embedding and head."""

    wants_hidden = True

    def __init__(self, model, layer: MtpLayer, vocab_size: int | None):
        holder = getattr(model, "language_model", model)
        self.recorder: HiddenRecorder = holder.lm_head
        self.embed = _inner_model(model).embed_tokens
        self.layer = layer
        self.vocab_size = vocab_size

    def index(self) -> MtpSequence:
        return MtpSequence(self)

    def last_hidden(self) -> mx.array:
        """[B, W, H]: the final hidden states of the forward that just returned."""
        return self.recorder.hidden

    def draft_token(self, out: mx.array) -> mx.array:
        logits = self.recorder.head(out)[0, -1]
        return mx.argmax(logits[: self.vocab_size] if self.vocab_size else logits)


class MtpSequence:
    """One sequence's MTP state. `confirm(hidden, tokens)` after each verify forward: the main
    model's hidden states at the positions it confirmed, each with the token that follows it;
    `propose(context, k)` drafts k tokens from the last of them (a lazy [k] array)."""

    def __init__(self, drafter: MtpDrafter):
        self.drafter = drafter
        self.cache = KVCache()
        self.confirmed = 0  # positions in `cache` that verification confirmed
        self._last: tuple[mx.array, mx.array] | None = None  # (normed output, its token), last position

    def confirm(self, hidden: mx.array, tokens: list[int]) -> None:
        """hidden [1, m, H], tokens [m]: feed the confirmed pairs through the layer."""
        if self.cache.offset > self.confirmed:
            self.cache.trim(self.cache.offset - self.confirmed)
        token_ids = mx.array([tokens])
        out = self.drafter.layer(self.drafter.embed(token_ids), hidden, self.cache)
        self.confirmed += len(tokens)
        self._last = (out[:, -1:], self.drafter.draft_token(out))

    def propose(self, context: list[int], k: int) -> mx.array | list[int]:
        if k <= 0 or self._last is None:
            return []
        out, token = self._last
        drafts = [token]
        for _ in range(k - 1):
            out = self.drafter.layer(self.drafter.embed(token.reshape(1, 1)), out, self.cache)
            token = self.drafter.draft_token(out)
            drafts.append(token)
        return mx.stack(drafts)

    def state(self) -> list[mx.array]:
        """What to evaluate with the step's drafts so the cache never holds an unbounded graph."""
        return (
            [self._last[1], self.cache.keys, self.cache.values]
            if self._last and self.cache.keys is not None
            else []
        )
