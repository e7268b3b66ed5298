"""Language models of vision-language families mlx-lm has no class for, built from mlx-lm's own.

GLM-4.5V and GLM-4.6V (`glm4v_moe`) run GLM-4.5's language model (mlx-lm's `glm4_moe`) with 3-D
rotary positions over image tokens. Text positions are equal on all three axes, and there mlx-vlm's
sectioned, half-split rotation is mlx-lm's plain rotation, so core serves the family with `glm4_moe`
under `language_model` (the path mlx-vlm gives it); the image prompts' 3-D positions are mlx-vlm's
(services/core/vision/).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx import nn
from mlx_lm.models import glm4_moe
from mlx_lm.models.base import BaseModelArgs

LANGUAGE_PREFIX = "language_model."


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict


def _glm4_moe_args(text_config: dict) -> glm4_moe.ModelArgs:
    fields = dict(text_config)
    fields.setdefault("rope_theta", (fields.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    fields.setdefault("rope_scaling", None)
    fields.setdefault("tie_word_embeddings", False)
    return glm4_moe.ModelArgs.from_dict(fields)


class Glm4vMoeModel(nn.Module):
    """GLM-4.5V's language model: mlx-lm's glm4_moe under `language_model`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = glm4_moe.Model(_glm4_moe_args(args.text_config))

    def __call__(self, inputs, cache=None):
        return self.language_model(inputs, cache=cache)

    def sanitize(self, weights: dict) -> dict:
        """The language model's weights, from Hugging Face's layout (`model.language_model.*`,
        `lm_head.*`) or mlx-vlm's (`language_model.model.*`); the vision tower's are left out."""
        text = {}
        for key, value in weights.items():
            if key.startswith("model.language_model."):
                text["model." + key.removeprefix("model.language_model.")] = value
            elif key.startswith("lm_head."):
                text[key] = value
            elif key.startswith(LANGUAGE_PREFIX):
                text[key.removeprefix(LANGUAGE_PREFIX)] = value
        return {LANGUAGE_PREFIX + k: v for k, v in self.language_model.sanitize(text).items()}

    @property
    def layers(self):
        return self.language_model.layers

    @property
    def cast_predicate(self):
        return self.language_model.cast_predicate


# model_type -> (Model, ModelArgs), as mlx-lm's `_get_classes` gives them
VL_TEXT_CLASSES = {"glm4v_moe": (Glm4vMoeModel, ModelArgs)}
