"""Core's quantized projections on the CPU kernel (metal/linear_cpu.py) compute what MLX's
quantized matmul computes, leave to MLX what they must, and keep the model's parameters as loaded."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from metal import linear_cpu

pytestmark = pytest.mark.skipif(not linear_cpu.available(), reason="the C extension is not built here")


def quantized(in_dim: int, out_dim: int, bits: int, group: int, scale_dtype=mx.float32, bias=False):
    mx.random.seed(in_dim * 7 + out_dim + bits)
    module = nn.QuantizedLinear.from_linear(
        nn.Linear(in_dim, out_dim, bias=bias), group_size=group, bits=bits
    )
    module.scales = module.scales.astype(scale_dtype)
    module.biases = module.biases.astype(scale_dtype)
    mx.eval(module.parameters())
    return module


def exact(module: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """x @ W.T in float32 with the dequantized weights: what the kernel's float32 sums approach."""
    w = mx.dequantize(
        module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
        group_size=module.group_size, bits=module.bits,
    )  # fmt: skip
    return x.astype(mx.float32) @ w.T


@pytest.mark.parametrize(
    ("in_dim", "out_dim", "bits", "group"),
    [(576, 576, 4, 32), (256, 100, 2, 64), (512, 37, 8, 128), (128, 2048, 4, 64)],
)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_float32_products_equal_mlx(in_dim, out_dim, bits, group, tokens):
    module = quantized(in_dim, out_dim, bits, group)
    x = mx.random.normal((2, tokens, in_dim))
    want = module(x)
    object.__setattr__(module, "_cpu_rows", linear_cpu._rows(module, head=False))
    got = linear_cpu.KernelQuantizedLinear.__call__(module, x)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_a_product_big_enough_for_threads_equals_the_one_thread_result(monkeypatch):
    module = quantized(1024, 1000, 4, 64)  # 1000 rows: tiles split unevenly over the threads
    rows = linear_cpu._rows(module, head=False)
    x = mx.random.normal((16, 1024))
    assert 16 * 1024 * 1000 >= linear_cpu.PARALLEL_MACS
    threaded = linear_cpu.product(rows, x)
    monkeypatch.setattr(linear_cpu, "PARALLEL_MACS", 1 << 62)
    assert mx.array_equal(linear_cpu.product(rows, x), threaded)  # same sums, per row, in any thread
    assert mx.abs(threaded - module(x)).max().item() <= 1e-5 * mx.abs(threaded).max().item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_products_are_float32_sums_rounded_once(dtype):
    module = quantized(512, 96, 4, 64, scale_dtype=dtype)
    x = mx.random.normal((5, 512)).astype(dtype)
    got = linear_cpu.product(linear_cpu._rows(module, head=False), x)
    assert got.dtype == dtype == module(x).dtype
    want = exact(module, x)
    ulp = 2.0**-10 if dtype == mx.float16 else 2.0**-7  # at 1.0; the sums' order may flip a rounding
    assert (mx.abs(got.astype(mx.float32) - want) <= ulp * mx.abs(want) + 1e-6).all().item()


def test_mixed_input_and_scale_types_compute_in_float32_as_mlx_promotes():
    module = quantized(256, 64, 4, 64, scale_dtype=mx.bfloat16)
    x = mx.random.normal((3, 256))  # float32 x, bf16 scales: MLX computes in float32
    got = linear_cpu.product(linear_cpu._rows(module, head=False), x)
    assert got.dtype == module(x).dtype == mx.float32
    assert mx.abs(got - exact(module, x)).max().item() <= 1e-5 * mx.abs(got).max().item()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 128)
        self.proj = nn.Linear(128, 128, bias=True)
        self.lm_head = nn.Linear(128, 300, bias=False)

    def __call__(self, ids):
        return self.lm_head(self.proj(self.embed(ids)))


def test_use_cpu_kernels_keeps_the_parameters_and_the_outputs():
    model = TinyLM()
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    before = {k: v for k, v in tree_flatten(model.parameters())}
    ids = mx.array([list(range(1, 3 + linear_cpu.HEAD_POSITIONS))])  # more than a head takes
    want_all, want_last = model(ids), model(ids[:, -1:])
    settled = []
    assert (
        linear_cpu.use_cpu_kernels(model, settle=lambda: settled.append(1)) == 3
    )  # proj, lm_head, embedding
    after = {k: v for k, v in tree_flatten(model.parameters())}
    assert before.keys() == after.keys() and all(after[k] is before[k] for k in before)
    assert isinstance(model.proj, nn.QuantizedLinear) and isinstance(
        model.proj, linear_cpu.KernelQuantizedLinear
    )
    for got, want in ((model(ids), want_all), (model(ids[:, -1:]), want_last)):
        assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    assert len(settled) == 1 + 2  # proj at every position (the head: MLX), then proj and head at one


def test_an_output_head_takes_the_kernel_for_a_few_positions_only():
    """mlx-lm evaluates only a prompt's last logits and MLX prunes the rest: an eager head would
    compute them all, so a head leaves inputs of many positions to MLX's lazy op, and takes those
    of a decode step or of one that verifies a few drafted tokens."""
    module = quantized(128, 300, 4, 64)
    head = linear_cpu._rows(module, head=True)
    assert linear_cpu.product(head, mx.random.normal((1, linear_cpu.HEAD_POSITIONS + 1, 128))) is None
    assert linear_cpu.product(head, mx.random.normal((4, 1, 128))).shape == (4, 1, 300)  # a decode step of 4
    x = mx.random.normal((2, 5, 128))  # two rows verifying four drafted tokens each
    want = mx.quantized_matmul(x, module.weight, module.scales, module.biases, group_size=64, bits=4)
    got = linear_cpu.product(head, x)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    assert linear_cpu.product(linear_cpu._rows(module, head=False), mx.random.normal((1, 6, 128))) is not None


def test_a_caller_that_uses_every_positions_logits_can_put_the_head_on_the_kernel_too():
    model = TinyLM()
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    ids = mx.array([[1, 5, 7, 9]])
    want = model(ids)
    linear_cpu.use_cpu_kernels(model, heads_at_few_positions_only=False)
    assert not model.lm_head._cpu_rows.heads_at_few_positions_only
    assert linear_cpu.product(model.lm_head._cpu_rows, mx.random.normal((1, 4, 128))) is not None
    assert mx.abs(model(ids) - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_inside_mx_compile_the_projection_is_mlx_own():
    module = quantized(128, 64, 4, 64)
    linear_cpu.use_cpu_kernels(module)
    x = mx.random.normal((2, 128))
    want = mx.quantized_matmul(
        x, module.weight, module.scales, module.biases, transpose=True, group_size=64, bits=4
    )
    assert mx.allclose(mx.compile(module)(x), want, rtol=1e-6, atol=1e-6)


def test_what_the_kernel_does_not_take_stays_on_mlx():
    three_bit = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), group_size=64, bits=3)
    assert linear_cpu._rows(three_bit, head=False) is None
    model = TinyLM()
    nn.quantize(model, group_size=64, bits=3)
    assert linear_cpu.use_cpu_kernels(model) == 0
    assert type(model.proj) is nn.QuantizedLinear
