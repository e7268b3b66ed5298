"""`--speculative mtp` on Qwen3.5 / Qwen3-Next: split reads the `mtp.*` layer, converting it as
the model's own layers are converted, and the layer drafts on the hybrid model with greedy tokens
those of decoding without it (the recurrent layers replay what each verify rejects)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from services.common.mlx_lm_adapter import classes_for_config
from services.core.speculative import SpeculativeConfig, SpeculativeCounters, SpeculativeDecoder
from services.core.speculative.mtp import HiddenRecorder, MtpDrafter, check_mtp_servable, load_mtp, text_model
from services.core.speculative.mtp_weights import MTP_FILE, extract_mtp_weights, mtp_block_index
from services.core.speculative.recurrent_rows import recurrent_rows
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from services.tools.split import split_checkpoint
from services.tools.synthetic_model import TINY_CONFIGS
from services.tools.tiny_mtp import MTP_SHARD
from tests.core.test_batching import GREEDY, run, running
from tests.core.test_mtp import load_with_mtp, reference_drafts
from tests.core.test_speculative import generate

ARCH = "qwen3_5_moe_mtp"
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    **{k: TINY_CONFIGS["qwen3_5_moe"]["text_config"][k] for k in ("hidden_size", "num_hidden_layers")},
    **{k: v for k, v in TINY_CONFIGS["qwen3_5_moe"]["text_config"].items() if k.startswith("linear_")},
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 32,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "full_attention_interval": 2,
    "mtp_num_hidden_layers": 1,
}


@pytest.fixture(scope="module")
def split(tiny_models):
    return tiny_models.split(ARCH, None)


@pytest.fixture(scope="module")
def mtp_model(tiny_models, split):
    return load_with_mtp(tiny_models, ARCH, split)


def test_split_keeps_the_mtp_layer_for_core_under_the_drafter_names(split):
    weights = mx.load(str(split / "core" / MTP_FILE))
    names = set(weights)
    assert {
        "mtp.0.enorm.weight",  # mtp.pre_fc_norm_embedding
        "mtp.0.hnorm.weight",  # mtp.pre_fc_norm_hidden
        "mtp.0.eh_proj.weight",  # mtp.fc
        "mtp.0.shared_head.norm.weight",  # mtp.norm
        "mtp.0.self_attn.q_proj.weight",  # a full-attention layer, never a linear-attention one
    } <= names
    assert weights["mtp.0.mlp.switch_mlp.gate_proj.weight"].shape[0] == 8  # gate_up_proj unfused
    assert not any("linear_attn" in n or "gate_up" in n or ".fc." in n for n in names)
    manifest = json.loads((split / "manifest.json").read_text())
    assert [layer["layer"] for layer in manifest["layers"]] == [0, 1, 2, 3]  # workers get no MTP layer


def test_a_split_of_files_without_the_mtp_layer_is_refused_saying_why(tiny_models, tmp_path):
    """mlx-lm's conversions drop `mtp.*` while their config still declares the layer: the split
    goes ahead without it and `--speculative mtp` names the cause."""
    checkpoint = tmp_path / "converted"
    shutil.copytree(tiny_models.checkpoint(ARCH, None), checkpoint)
    (checkpoint / MTP_SHARD).unlink()
    split_checkpoint(checkpoint, tmp_path / "split", progress=False)
    config = json.loads((tmp_path / "split" / "core" / "config.json").read_text())
    with pytest.raises(ValueError, match="made from files without MTP weights"):
        check_mtp_servable(tmp_path / "split", config)


def _mlx_form_layer(model, config: dict) -> dict[str, mx.array]:
    """A random MTP layer as core's drafter holds it: DeepSeek's names, experts stacked, norms
    offset (and made to differ from one, so a wrong offset shows)."""
    text = text_model(model)
    block = type(text.model.layers[-1])(text.args, mtp_block_index(config))
    hidden = text.args.hidden_size
    params = {
        **dict(tree_flatten(block.parameters())),
        "enorm.weight": mx.ones((hidden,)),
        "hnorm.weight": mx.ones((hidden,)),
        "shared_head.norm.weight": mx.ones((hidden,)),
        "eh_proj.weight": mx.random.normal((hidden, 2 * hidden)),
    }
    return {k: (v + mx.random.uniform(-0.5, 0.5, v.shape) if _is_norm(k) else v) for k, v in params.items()}


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layernorm.weight")) and "linear_attn" not in name


def _checkpoint_files(folder: Path, layer: dict, family: str, hugging_face: bool) -> Path:
    """The layer stored as a checkpoint stores it beside one of the model's own layers: Hugging
    Face's files (zero-centred norms, experts fused for Qwen3.5 and one per expert for Qwen3-Next,
    convolutions [C, 1, K]) or MLX's (as core holds it)."""
    shared = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight"}
    shared |= {"shared_head.norm.weight": "norm.weight", "eh_proj.weight": "fc.weight"}
    out = {}
    for name, stored in layer.items():
        value = stored - 1.0 if hugging_face and _is_norm(name) else stored
        key = "mtp." + shared[name] if name in shared else f"mtp.layers.0.{name}"
        if not hugging_face or ".switch_mlp." not in name:
            out[key] = value
        elif family == "qwen3_next":
            out.update({key.replace(".switch_mlp.", f".experts.{e}."): value[e] for e in range(8)})
        elif name.endswith("down_proj.weight"):
            out[key.replace(".switch_mlp.down_proj.weight", ".experts.down_proj")] = value
        elif name.endswith("gate_proj.weight"):
            up = layer[name.replace("gate_proj", "up_proj")]
            out[key.replace(".switch_mlp.gate_proj.weight", ".experts.gate_up_proj")] = mx.concatenate(
                [value, up], axis=-2
            )
    prefix = {"qwen3_next": "model."}.get(
        family, "model.language_model." if hugging_face else "language_model.model."
    )
    conv = mx.zeros((32, 1, 4) if hugging_face else (32, 4, 1))
    out[f"{prefix}layers.0.linear_attn.conv1d.weight"] = conv
    out[f"{prefix}layers.0.input_layernorm.weight"] = mx.zeros((64,))
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), out)
    return folder


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hugging_face_and_mlx_files_give_the_layer_core_holds(tmp_path, family):
    config = TINY_CONFIGS[ARCH] if family == "qwen3_5_moe" else QWEN3_NEXT
    model_class, args_class = classes_for_config(config)
    model = model_class(args_class.from_dict(config))
    layer = _mlx_form_layer(model, config)
    for hugging_face in (True, False):
        files = _checkpoint_files(tmp_path / str(hugging_face), layer, family, hugging_face)
        extracted = extract_mtp_weights(files, config, model)
        assert set(extracted) == {f"mtp.0.{name}" for name in layer}, hugging_face
        for name, value in layer.items():
            assert mx.allclose(extracted[f"mtp.0.{name}"], value, atol=1e-6), (hugging_face, name)
    (tmp_path / "split" / "core").mkdir(parents=True)
    mx.save_safetensors(str(tmp_path / "split" / "core" / MTP_FILE), extracted)
    raw = mx.load(str(tmp_path / "True" / "model.safetensors"))
    assert_computes_what_hugging_face_defines(model, config, tmp_path / "split", raw)


def assert_computes_what_hugging_face_defines(model, config: dict, split: Path, raw: dict[str, mx.array]):
    """The drafter's layer, loaded from the converted weights, computes Qwen's MTP forward as its
    reference code defines it on the files' own weights: zero-centred norms scale by (1 + w), `fc`
    takes the normed embedding first and the normed hidden state second, `norm` comes last."""
    text = text_model(model)
    layer = load_mtp(model, split, config)
    embedded, hidden = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    out = layer(embedded, hidden, KVCache())

    def norm(x, weight):
        return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1.0 + weight)

    x = mx.concatenate(
        [
            norm(embedded, raw["mtp.pre_fc_norm_embedding.weight"]),
            norm(hidden, raw["mtp.pre_fc_norm_hidden.weight"]),
        ],
        axis=-1,
    )
    x = x @ raw["mtp.fc.weight"].T
    expected = norm(
        layer.block(x, create_attention_mask(x, None, return_array=True), KVCache()), raw["mtp.norm.weight"]
    )
    assert isinstance(text.lm_head, HiddenRecorder)
    assert mx.allclose(out, expected, atol=1e-4)


def test_mtp_drafts_equal_the_layer_run_from_scratch_across_rejections(mtp_model):
    """Fed in pieces (a prefill chunk, verify forwards with drafted positions cut off, a step that
    drafts nothing), the layer drafts what it computes over the whole context at once."""
    model, layer = mtp_model
    drafter = MtpDrafter(model, layer, None)
    sequence = drafter.index()
    context = [5, 9, 17, 33, 2, 71, 8]
    fed = len(context) - 1
    model(mx.array([context[:fed]]))
    sequence.feed(drafter.last_hidden(), context[:fed])
    for extra, drafting in (([40, 41, 42], True), ([7], False), ([90, 91], True)):
        if drafting:
            drafts = sequence.propose(context, 3)
            mx.eval(drafts)
            assert drafts.tolist() == reference_drafts(model, layer, context, 3)
        context = context + extra
        model(mx.array([context[:-1]]))
        sequence.feed(drafter.last_hidden()[:, fed:], context[fed:-1])
        fed = len(context) - 1


@pytest.mark.slow  # decodes for seconds
@pytest.mark.parametrize("kind", ["fp16", "turboquant"])
def test_greedy_tokens_equal_decoding_without_mtp_on_the_hybrid_model(mtp_model, kind):
    model, layer = mtp_model
    reference, _, plain_steps, _ = generate(model, kind, None)
    decoder = SpeculativeDecoder(
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, draft_cost=0.0),
        SpeculativeCounters(),
        drafter=MtpDrafter(model, layer, None),
        recurrent=recurrent_rows(model),
    )
    tokens, _, steps, _ = generate(model, kind, decoder)
    assert tokens == reference
    assert decoder.counters.draft_tokens > 0 and steps <= plain_steps


@pytest.mark.slow
async def test_a_core_drafting_with_mtp_gives_the_tokens_of_one_without(split):
    """Real core processes over a worker, prefix cache on: a repeated prompt resumes from its entry."""
    configs = {
        "off": [],
        "mtp": [
            "--speculative",
            "mtp",
            "--num-speculative-tokens",
            "2",
            "--speculative-config",
            '{"draft_cost": 0}',
        ],
    }
    stopping = core_pb2.StoppingCriteria(max_tokens=20, ignore_eos=True)
    requests = [
        core_pb2.GenerateRequest(prompt=p, sampling=GREEDY, stopping=stopping)
        for p in ("Hello there", "1 2 3 4")
    ]
    answers, stats = {}, {}
    with running(split, configs) as cores:
        for name, core in cores.items():
            async with grpc.aio.insecure_channel(core.address) as channel:
                stub = core_pb2_grpc.CoreStub(channel)
                first = await asyncio.gather(*(run(stub, r) for r in requests))
                again = await run(stub, requests[0])
                answers[name] = [tokens for tokens, _ in [*first, again]]
                stats[name] = await stub.GetStats(core_pb2.GetStatsRequest())
    assert answers["mtp"] == answers["off"]
    assert all(len(tokens) == 20 for tokens in answers["mtp"])
    assert stats["mtp"].speculative.draft_tokens > 0
