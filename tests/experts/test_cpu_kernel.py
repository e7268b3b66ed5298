"""metal/experts_cpu.c, the expert workers' CPU kernel, against the oracle: mlx-lm's own
SwitchGLU on the same quantized weights; and where ExpertCompute uses it."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from metal import experts_cpu
from metal.experts_cpu import SwitchGLUKernel
from services.common import tensor_codec
from services.common.manifest import Manifest
from services.core.model_loader import load_core_model
from services.experts.compute import ExpertCompute
from services.experts.store import ResidentExpertStore
from services.experts.streaming_store import StreamingExpertStore, expert_bytes
from services.proto.moemesh.v1 import expert_pb2
from tests.helpers import linked_dispatcher

pytestmark = pytest.mark.skipif(
    not experts_cpu.available(), reason="metal._experts_cpu was not built (no C compiler at install)"
)

HIDDEN, INTER, EXPERTS = 256, 128, 6


def quantized_switch_glu(bits: int, group_size: int, dtype=mx.float32, seed: int = 0, **kwargs) -> SwitchGLU:
    mx.random.seed(seed)
    module = SwitchGLU(HIDDEN, INTER, EXPERTS, **kwargs)
    nn.quantize(module, group_size=group_size, bits=bits)
    module.set_dtype(dtype)
    mx.eval(module.parameters())
    return module


def ids_with_repeats(tokens: int, k: int, seed: int) -> np.ndarray:
    """[tokens, k] expert ids in which some experts serve more than 4 pairs (the kernel's block)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(EXPERTS, k, replace=False) for _ in range(tokens)]).astype(np.int32)


def host(x: mx.array) -> np.ndarray:
    return tensor_codec.numpy_view(x)


def as_float32(wire: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(tensor_codec.to_mlx(wire).astype(mx.float32)) if dtype != mx.float32 else wire


def kernel_rows(kernel: SwitchGLUKernel, x: mx.array, ids: np.ndarray, threads: int = 1) -> np.ndarray:
    tokens = np.repeat(np.arange(ids.shape[0], dtype=np.int32), ids.shape[1])
    return kernel(host(x), tokens, ids.ravel(), threads)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_float32_equals_mlx_lm(bits, group_size):
    module = quantized_switch_glu(bits, group_size)
    kernel = SwitchGLUKernel.for_module(module)
    assert kernel is not None
    ids = ids_with_repeats(9, 3, seed=bits)
    x = mx.random.normal((9, HIDDEN), key=mx.random.key(group_size))
    want = np.asarray(module(x, mx.array(ids)).reshape(-1, HIDDEN))
    got = kernel_rows(kernel, x, ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    relative = np.abs(got - want).max() / np.abs(want).max()
    assert relative < 1e-5, f"{relative:.2e}"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_portable_loop_computes_what_the_avx2_one_does(bits):
    """Where the CPU has no AVX2 (or is not x86: a Mac's CPU) the plain C loop computes."""
    module = quantized_switch_glu(bits, 32)
    kernel = SwitchGLUKernel.for_module(module)
    ids = ids_with_repeats(7, 3, seed=bits)
    x = mx.random.normal((7, HIDDEN), key=mx.random.key(bits))
    want = np.asarray(module(x, mx.array(ids)).reshape(-1, HIDDEN))
    experts_cpu.force_portable(True)
    try:
        portable = kernel_rows(kernel, x, ids)
    finally:
        experts_cpu.force_portable(False)
    assert np.abs(portable - want).max() / np.abs(want).max() < 1e-5
    assert np.abs(portable - kernel_rows(kernel, x, ids)).max() / np.abs(want).max() < 1e-5


def test_pairs_in_any_order_and_threads_change_nothing():
    module = quantized_switch_glu(4, 64)
    kernel = SwitchGLUKernel.for_module(module)
    x = mx.random.normal((40, HIDDEN), key=mx.random.key(1))
    ids = ids_with_repeats(40, 4, seed=2)
    one = kernel_rows(kernel, x, ids, threads=1)
    assert np.array_equal(one, kernel_rows(kernel, x, ids, threads=3))
    # a subset of the pairs, shuffled: the same rows, in the order asked
    rng = np.random.default_rng(3)
    pick = rng.permutation(ids.size)[:50]
    tokens = np.repeat(np.arange(40, dtype=np.int32), 4)[pick]
    some = kernel(host(x), tokens, ids.ravel()[pick])
    np.testing.assert_allclose(some, one[pick], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["float16", "bfloat16"])
def test_half_types_stay_as_close_to_float32_math_as_mlx_does(dtype):
    """In float16/bfloat16 there is no one right answer: MLX's CPU kernel accumulates in the
    half type, the kernel in float32. Both are held against the same weights in float32 math."""
    module = quantized_switch_glu(4, 64, dtype)
    kernel = SwitchGLUKernel.for_module(module)
    exact = quantized_switch_glu(4, 64)
    exact.update(module.parameters())
    exact.set_dtype(mx.float32)
    ids = ids_with_repeats(6, 3, seed=4)
    x = mx.random.normal((6, HIDDEN), key=mx.random.key(5)).astype(dtype)
    truth = np.asarray(exact(x.astype(mx.float32), mx.array(ids)).reshape(-1, HIDDEN))
    mlx_rows = np.asarray(module(x, mx.array(ids)).reshape(-1, HIDDEN).astype(mx.float32))
    wire = kernel_rows(kernel, x, ids)
    assert wire.dtype == host(x).dtype  # written in the layer's dtype (bf16 as its bits)
    got = as_float32(wire, dtype)
    scale = np.abs(truth).max()
    kernel_error, mlx_error = np.abs(got - truth).max() / scale, np.abs(mlx_rows - truth).max() / scale
    assert kernel_error <= mlx_error, (kernel_error, mlx_error)
    assert kernel_error < (2e-3 if dtype == mx.float16 else 2e-2)


def test_half_hidden_states_over_float32_scales_compute_in_float32_as_mlx_does():
    """bf16 activations against float32 scales: MLX promotes to float32 and the worker casts the
    reply back, so the kernel rounds once, at the end: the same bf16 value or its neighbour."""
    module = quantized_switch_glu(4, 64)
    kernel = SwitchGLUKernel.for_module(module)
    ids = ids_with_repeats(6, 3, seed=8)
    x = mx.random.normal((6, HIDDEN), key=mx.random.key(9)).astype(mx.bfloat16)
    want = np.asarray(module(x, mx.array(ids)).reshape(-1, HIDDEN).astype(mx.bfloat16).astype(mx.float32))
    got = as_float32(kernel_rows(kernel, x, ids), mx.bfloat16)
    assert np.all(np.abs(got - want) <= 2**-7 * np.abs(want) + 1e-6)


def test_modules_it_does_not_take_are_left_to_mlx_lm():
    def quantized(module, bits=4, mode="affine"):
        nn.quantize(module, group_size=32, bits=bits, mode=mode)
        mx.eval(module.parameters())
        return module

    assert SwitchGLUKernel.for_module(SwitchGLU(HIDDEN, INTER, EXPERTS)) is None  # float weights
    assert SwitchGLUKernel.for_module(quantized(SwitchGLU(HIDDEN, INTER, EXPERTS, bias=True))) is None
    assert (
        SwitchGLUKernel.for_module(quantized(SwitchGLU(HIDDEN, INTER, EXPERTS, activation=nn.GELU()))) is None
    )
    assert SwitchGLUKernel.for_module(quantized(SwitchMLP(HIDDEN, INTER, EXPERTS))) is None
    assert SwitchGLUKernel.for_module(quantized(SwitchGLU(HIDDEN, INTER, EXPERTS), bits=3)) is None
    assert SwitchGLUKernel.for_module(quantized(SwitchGLU(HIDDEN, INTER, EXPERTS), mode="mxfp4")) is None
    # arrays whose shapes disagree with the layout (the C side would read past them; mlx-lm refuses)
    broken = quantized_switch_glu(4, 64)
    broken.up_proj.scales = broken.up_proj.scales[:2]
    assert SwitchGLUKernel.for_module(broken) is None
    broken = quantized_switch_glu(4, 64)
    broken.down_proj.biases = broken.down_proj.biases[:, :, :1]
    assert SwitchGLUKernel.for_module(broken) is None


def test_pairs_out_of_range_raise_instead_of_reading_past_the_weights():
    kernel = SwitchGLUKernel.for_module(quantized_switch_glu(4, 64))
    x = host(mx.zeros((2, HIDDEN)))
    with pytest.raises(ValueError, match="out of range"):
        kernel(x, np.array([0], dtype=np.int32), np.array([EXPERTS], dtype=np.int32))
    with pytest.raises(ValueError, match="out of range"):
        kernel(x, np.array([2], dtype=np.int32), np.array([0], dtype=np.int32))
    with pytest.raises(ValueError, match="equal-length"):
        kernel(x, np.array([0, 1], dtype=np.int32), np.array([0], dtype=np.int32))
    with pytest.raises(ValueError, match="hidden must be"):
        kernel(host(mx.zeros((2, HIDDEN + 1))), np.array([0], dtype=np.int32), np.array([0], dtype=np.int32))
    assert kernel(x, np.zeros(0, np.int32), np.zeros(0, np.int32)).shape == (0, HIDDEN)


def layer_call(layer: int, hidden: mx.array, ids: np.ndarray) -> expert_pb2.ExpertCall:
    return expert_pb2.ExpertCall(
        call_id=1,
        layer=layer,
        hidden=tensor_codec.encode(hidden),
        expert_ids=tensor_codec.encode(mx.array(ids)),
    )


def worker_calls(manifest: Manifest, count: int):
    rng = np.random.default_rng(7)
    for i in range(count):
        layer = manifest.layers[i % len(manifest.layers)]
        tokens = int(rng.integers(1, 12))
        ids = np.stack([rng.choice(layer.num_experts, 3, replace=False) for _ in range(tokens)]).astype(
            np.int32
        )
        if i % 3 == 1:  # a call for part of a layer's experts, as when they are spread over workers
            ids[rng.random(ids.shape) < 0.4] = -1
        yield layer_call(layer.layer, mx.random.normal((tokens, manifest.hidden_size)), ids)


def test_worker_uses_the_kernel_on_quantized_layers_with_mlx_lm_numbers(tiny_models):
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    owned = {layer.layer: list(range(layer.num_experts)) for layer in manifest.layers}
    fast = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    reference = ExpertCompute(ResidentExpertStore(split, manifest, owned), kernel="mlx")
    assert fast.kernel_name == "cpu" and reference.kernel_name == "mlx"
    for call in worker_calls(manifest, 24):
        got = tensor_codec.decode_numpy(fast.run(call).output, "output", 1 << 30, ndim=2)
        want = tensor_codec.decode_numpy(reference.run(call).output, "output", 1 << 30, ndim=2)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=0))
    # a call split over threads (as a prefill call is) gives the same bytes
    threaded = ExpertCompute(ResidentExpertStore(split, manifest, owned), threads=3)
    threaded.macs_per_thread = 1
    for call in worker_calls(manifest, 6):
        assert threaded.run(call).output.data == fast.run(call).output.data
    # float weights: mlx-lm's module computes (the kernel takes quantized layers only)
    float_split = tiny_models.split("qwen3_moe", None)
    float_manifest = Manifest.load(float_split)
    assert ExpertCompute(ResidentExpertStore(float_split, float_manifest, owned)).kernel_name == "mlx"


def test_bf16_scales_under_float32_activations_match_mlx_lm(tiny_models):
    """The common real-checkpoint case: bf16 weights and scales, float32 norms, so hidden states
    reach the experts in float32 and MLX computes in float32."""
    split = tiny_models.split("qwen3_moe", 4, "bf16-f32-norms")
    manifest = Manifest.load(split)
    owned = {layer.layer: list(range(layer.num_experts)) for layer in manifest.layers}
    fast = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    reference = ExpertCompute(ResidentExpertStore(split, manifest, owned), kernel="mlx")
    assert fast.kernel_name == "cpu"
    for call in worker_calls(manifest, 12):
        got = tensor_codec.decode_numpy(fast.run(call).output, "output", 1 << 30, ndim=2)
        want = tensor_codec.decode_numpy(reference.run(call).output, "output", 1 << 30, ndim=2)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=0))


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize(
    "flags, kernel", [((), "cpu"), (("--expert-kernel", "mlx"), "mlx")], ids=["auto", "mlx"]
)
def test_worker_flag_picks_what_computes_and_core_still_matches_mlx_lm(tiny_models, short_tmp, flags, kernel):
    source, split = tiny_models.checkpoint("qwen3_moe", 4), tiny_models.split("qwen3_moe", 4)
    reference, _ = mlx_lm.load(str(source))
    prompt = mx.array(list(range(1000, 1016)))[None]
    worker_args = (*flags, "--compute-threads", "2")
    with linked_dispatcher(split, short_tmp, ["all"], tag=kernel, worker_args=worker_args) as (
        workers,
        dispatcher,
        manifest,
    ):
        core, _ = load_core_model(split, manifest, dispatcher)
        want, got = reference(prompt)[0, -1], core(prompt)[0, -1]
        assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 1e-4
    serving = [
        json.loads(line) for line in workers.logs[0].read_text().splitlines() if "worker_serving" in line
    ]
    assert serving and serving[0]["expert_kernel"] == kernel


def test_streamed_experts_reach_the_kernel_as_they_are_read(tiny_models):
    """The kernel reads the streaming store's slots in place: experts read into a slot after the
    kernel took its views must be what it computes with (bf16 scales: the case where MLX hands
    out a view of another dtype)."""
    split = tiny_models.split("qwen3_moe", 4, "bf16-f32-norms")
    manifest = Manifest.load(split)
    owned = {layer.layer: list(range(layer.num_experts)) for layer in manifest.layers}
    resident = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    store = StreamingExpertStore(split, manifest, owned, 3 * expert_bytes(manifest.layers[0]))
    streaming = ExpertCompute(store)
    assert resident.kernel_name == streaming.kernel_name == "cpu"
    for call in worker_calls(manifest, 30):
        call.hidden.CopyFrom(
            tensor_codec.encode(tensor_codec.decode(call.hidden, "h", 1 << 30).astype(mx.bfloat16))
        )
        assert streaming.run(call).output.data == resident.run(call).output.data
    assert store.stats().evictions > 0
    store.close()
