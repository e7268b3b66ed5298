"""What some families' mlx-lm Model classes need around them before moe-mesh can load and serve them.

Llama 4 runs with caches core's engine can batch (chunked_attention.py). Kimi-VL's checkpoint
layout, which mlx-lm's own `sanitize` leaves unconverted, is converted before the weights load:

mlx-lm's `kimi_vl` runs DeepSeek-V3's language model, whose attention keeps the MLA up-projection
as two per-head matrices (`embed_q`, `unembed_out`). DeepSeek-V3's `sanitize` makes them from the
checkpoint's `kv_b_proj`, but `kimi_vl`'s does not call it, so a Kimi-VL checkpoint as published
(and as mlx-vlm saves it) fails to load. `model_classes` hands `mlx_lm.utils.load_model` a Model
whose `sanitize` also runs DeepSeek-V3's over the language model's `kv_b_proj` weights.
"""

from __future__ import annotations

from types import SimpleNamespace

from services.common.chunked_attention import with_batch_chunked_attention
from services.common.mlx_lm_adapter import classes_for_config
from services.common.vl_text_models import LANGUAGE_PREFIX, VL_TEXT_CLASSES
from services.common.vlm_language_models import model_classes as vlm_language_classes


def _with_deepseek_v3_language(model_class):
    from mlx_lm.models import deepseek_v3

    class Model(model_class):
        def sanitize(self, weights):
            weights = super().sanitize(weights)
            # Only the up-projections go through DeepSeek-V3's sanitize: it also drops what it
            # takes for DeepSeek-V3's MTP layer (`model.layers.61`), which a deeper model would need.
            up = {k: weights.pop(k) for k in [k for k in weights if ".kv_b_proj." in k]}
            if not up:  # already in mlx-lm's layout
                return weights
            language = {k.removeprefix(LANGUAGE_PREFIX): v for k, v in up.items()}
            converted = deepseek_v3.Model.sanitize(SimpleNamespace(args=self.args.text_config), language)
            return {**weights, **{LANGUAGE_PREFIX + k: v for k, v in converted.items()}}

    Model.__name__ = Model.__qualname__ = model_class.__name__
    return Model


# model_type -> what its mlx-lm Model class needs around it
_MENDED = {"kimi_vl": _with_deepseek_v3_language, "llama4": with_batch_chunked_attention}


def model_classes(config: dict):
    """(Model, ModelArgs) for `config`, as `mlx_lm.utils.load_model`'s `get_model_classes` takes
    them: mlx-lm's own, with the layout conversions above where its family needs one, or one made
    of mlx-lm's for a vision-language family it lacks (vl_text_models.py), or mlx-vlm's language
    model where only mlx-vlm has one (vlm_language_models.py)."""
    own = VL_TEXT_CLASSES.get(config.get("model_type")) or vlm_language_classes(config)
    if own is not None:
        return own
    model_class, args_class = classes_for_config(config)
    mend = _MENDED.get(config.get("model_type"))
    return (mend(model_class) if mend else model_class), args_class
