"""mlx-vlm's models, built as its loader builds them, and the language models only mlx-vlm builds,
under mlx-lm's model contract.

DeepSeek-VL2 runs DeepSeek-V2's language model in variants mlx-lm's `deepseek_v2` lacks (plain
multi-head attention where `qk_nope_head_dim` is 0, `noaux_tc` routing). Core and workers build
mlx-vlm's own language model for it, as mlx-vlm's Model holds it (under
`language_model`), with two changes:

- its routed experts are mlx-lm's `SwitchGLU`, of the same shapes and activation: the class core
  replaces with remote experts and workers compute (mlx-vlm's own adds fused decode paths over
  the same math);
- it is called as mlx-lm calls a model, `model(inputs, cache=...)` -> logits.

Caches are mlx-lm's (one `KVCache` a layer), which the engine batches; the attention code is
mlx-vlm's, reading masks from those caches as mlx-lm's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx import nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

from services.common.module_paths import replace_modules

LANGUAGE = "language_model"
# families whose language model only mlx-vlm builds and core serves through this module
MLX_VLM_LANGUAGE_FAMILIES = ("deepseek_vl_v2",)


class VisionUnsupported(ValueError):
    """A vision-language checkpoint core cannot serve images for; the message names its family."""


def build_vision_model(config: dict) -> nn.Module:
    """mlx-vlm's model for `config`, as mlx-vlm's own loader builds it, with random weights."""
    try:
        from mlx_vlm.utils import get_model_and_args, update_module_configs
    except ImportError as error:
        raise VisionUnsupported(
            "mlx-vlm is not installed: pip install --no-deps -r requirements-vision.txt"
        ) from error
    config = dict(config)
    try:
        model_class, _ = get_model_and_args(config=config)
    except ValueError as error:
        raise VisionUnsupported(f"mlx-vlm has no model for {config.get('model_type')!r}: {error}") from None
    if "language_config" in config:  # DeepSeek-VL2's name for it, which mlx-vlm's config reads too
        config.setdefault("text_config", config.pop("language_config"))
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(
        model_config, model_class, config, ["text", "vision", "perceiver", "projector", "audio"]
    )
    return model_class.Model(model_config)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict = field(default_factory=dict)
    language_config: dict = field(default_factory=dict)  # DeepSeek-VL2's name for it
    vision_config: dict = field(default_factory=dict)
    projector_config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, params: dict) -> ModelArgs:
        own = {k: params[k] for k in ("text_config", "language_config", "vision_config", "projector_config") if k in params}  # fmt: skip
        rest = {k: v for k, v in params.items() if k not in own and k != "model_type"}
        return cls(model_type=params["model_type"], **own, extra=rest)

    def config(self) -> dict:
        """The checkpoint's config as mlx-vlm reads it."""
        config = {**self.extra, "model_type": self.model_type, "vision_config": self.vision_config}
        config["text_config"] = self.text_config or self.language_config
        if self.projector_config:
            config["projector_config"] = self.projector_config
        return config


def mlx_lm_experts(module: nn.Module) -> SwitchGLU:
    """mlx-lm's SwitchGLU of the shapes and activation of mlx-vlm's `module` (random weights)."""
    experts, hidden, width = module.gate_proj.weight.shape
    activation = SwiGLU() if type(module.activation).__name__ == "SwiGLU" else module.activation
    return SwitchGLU(width, hidden, experts, activation=activation, bias="bias" in module.gate_proj)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        # mlx-vlm builds its language model inside its whole model, whatever its constructor takes
        try:
            whole = build_vision_model(args.config())
        except VisionUnsupported as error:  # text too needs mlx-vlm here
            raise ValueError(f"{args.model_type}'s language model is mlx-vlm's: {error}") from None
        self.language_model = getattr(whole, LANGUAGE)
        self._whole_sanitize = getattr(whole, "sanitize", None)  # a method: no child module
        for path, module in list(self.language_model.named_modules()):
            if type(module).__name__ == "SwitchGLU" and not isinstance(module, SwitchGLU):
                replace_modules(self.language_model, {path: mlx_lm_experts(module)})

    def __call__(self, inputs, cache=None):
        return self.language_model(inputs, cache=cache).logits

    def sanitize(self, weights: dict) -> dict:
        """The language model's weights, under `language_model`: mlx-vlm's conversion of the
        checkpoint's layout (Hugging Face's or mlx-vlm's), without the vision tower's."""
        if self._whole_sanitize is not None:
            weights = self._whole_sanitize(weights)
        weights = self.language_model.sanitize(weights)
        modules = {f"{LANGUAGE}.{path}" for path, _ in self.language_model.named_modules()}
        return {k: v for k, v in weights.items() if k.rpartition(".")[0] in modules}

    @property
    def layers(self):
        return self.language_model.layers


def model_classes(config: dict):
    """(Model, ModelArgs) for a family of MLX_VLM_LANGUAGE_FAMILIES, else None."""
    if config.get("model_type") not in MLX_VLM_LANGUAGE_FAMILIES:
        return None
    return Model, ModelArgs
