"""`EmbeddingsOnce`: a prompt's embeddings (image features in place) stand in for the language
model's token embeddings for exactly one call, whatever happens in it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from services.core.vision.prefill import EmbeddingsOnce, embeddings_owner


class TinyLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, 4)
        self.model.norm = nn.RMSNorm(4)


def forward(inner: nn.Module, ids: mx.array) -> mx.array:
    return inner.norm(inner.embed_tokens(ids))


def test_the_prompts_embeddings_serve_one_call_then_the_real_ones_are_back():
    language = TinyLanguageModel()
    inner = embeddings_owner(language)
    real = inner.embed_tokens
    ids, embeds = mx.array([[1, 2, 3]]), mx.full((1, 3, 4), 2.0)
    with EmbeddingsOnce(inner, ids, embeds):
        # in the module tree, in the real one's place, and empty
        assert [k for k, _ in nn.utils.tree_flatten(language.parameters())] == ["model.norm.weight"]
        assert list(inner) == ["embed_tokens", "norm"]
        first = forward(inner, ids)
        assert inner.embed_tokens is real  # put back on the call: a forward beside it embeds for real
        second = forward(inner, ids)
    assert mx.allclose(first, inner.norm(embeds)).item()
    assert mx.allclose(second, forward(inner, ids)).item() and not mx.allclose(first, second).item()
    assert [k for k, _ in nn.utils.tree_flatten(language.parameters())] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]


def test_the_real_embeddings_are_back_when_the_forward_fails_before_embedding():
    inner = embeddings_owner(TinyLanguageModel())
    real = inner.embed_tokens
    with pytest.raises(ZeroDivisionError), EmbeddingsOnce(inner, mx.array([[1]]), mx.zeros((1, 1, 4))):
        raise ZeroDivisionError
    assert inner.embed_tokens is real


def test_other_tokens_than_the_prompts_are_refused():
    inner = embeddings_owner(TinyLanguageModel())
    with EmbeddingsOnce(inner, mx.array([[1]]), mx.zeros((1, 1, 4))), pytest.raises(RuntimeError):
        inner.embed_tokens(mx.array([[1]]))
    assert isinstance(inner.embed_tokens, nn.Embedding)
