"""Language models of vision-language families mlx-lm has no class for, built from mlx-lm's own.

Some vision-language families run a language model mlx-lm already has, under `language_model` (the
path mlx-vlm gives it):

- GLM-4.5V and GLM-4.6V (`glm4v_moe`) run GLM-4.5's (`glm4_moe`) with 3-D rotary positions over
  image tokens. Text positions are equal on all three axes, and there mlx-vlm's sectioned,
  half-split rotation is mlx-lm's plain rotation, so core decodes with `glm4_moe`; image prompts
  take mlx-vlm's 3-D positions (services/core/vision/).
- Step-3.7 (`step3p7`) runs Step-3.5's (`step3p5`) with plain positions.

Weights load from Hugging Face's layout (`model.language_model.*` or `model.layers.*`, `lm_head.*`)
or mlx-vlm's (`language_model.*`); the vision tower's are left to mlx-vlm.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx import nn
from mlx_lm.models import glm4_moe, step3p5
from mlx_lm.models.base import BaseModelArgs

LANGUAGE_PREFIX = "language_model."
# checkpoint prefix -> the language model's own
_TEXT_PREFIXES = (("model.language_model.", "model."), (LANGUAGE_PREFIX, ""))


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


def _text_name(key: str) -> str:
    """A checkpoint tensor's name as the language model's own, where it is under a VL prefix."""
    for prefix, own in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return own + key.removeprefix(prefix)
    return key


def language_model_of(text_module, make_args):
    """A Model class running `text_module`'s mlx-lm Model under `language_model`, its args made by
    `make_args(text_config)`."""

    class Model(nn.Module):
        def __init__(self, args: ModelArgs):
            super().__init__()
            self.args = args
            self.model_type = args.model_type
            self.language_model = text_module.Model(make_args(args.text_config))

        def __call__(self, inputs, cache=None):
            return self.language_model(inputs, cache=cache)

        def sanitize(self, weights: dict) -> dict:
            """The language model's weights, under `language_model`, whichever layout they come in."""
            text = self.language_model.sanitize({_text_name(k): v for k, v in weights.items()})
            # what is left of the vision tower's names is no module of the language model
            modules = {path for path, _ in self.language_model.named_modules()}
            return {LANGUAGE_PREFIX + k: v for k, v in text.items() if k.rpartition(".")[0] in modules}

        @property
        def layers(self):
            return self.language_model.layers

        def __getattr__(self, name):
            # the language model's caches and predicates (cast, quantization), where it has them
            if name in ("make_cache", "cast_predicate", "quant_predicate"):
                return getattr(self["language_model"], name)
            return super().__getattr__(name)

    Model.__name__ = Model.__qualname__ = f"{text_module.__name__.rsplit('.', 1)[-1]}_language_model"
    return Model


# model_type -> (Model, ModelArgs), as mlx-lm's `_get_classes` gives them
VL_TEXT_CLASSES = {
    "glm4v_moe": (language_model_of(glm4_moe, _glm4_moe_args), ModelArgs),
    "step3p7": (language_model_of(step3p5, step3p5.ModelArgs.from_dict), ModelArgs),
}
