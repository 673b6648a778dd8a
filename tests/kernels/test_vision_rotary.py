"""The fused vision rotary embedding computes transformers' apply_rotary_pos_emb_vision bit for bit.

On the CPU the kernel runs through Triton's interpreter (numpy, fp32 arithmetic without fused
multiply-adds): fp32 and fp16 results equal transformers' exactly. The interpreter casts fp32 to bf16 by
truncation where the GPU rounds to nearest even, so in bf16 the test holds the kernel to transformers'
fp32 expression rounded toward zero; the bits of the GPU's bf16 rounding are what ``select`` checks on
the device before binding (bench/RESULTS.md has that check's GPU run).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision as reference

from videosft.kernels import fused, vision_rotary
from videosft.errors import ConfigError
from videosft.kernels.checks import KernelCheckError
from videosft.kernels.vision_attention import batch_vision_attention, vision_attention_modules


# The interpreter runs one program after another in Python: the checks' 4,096-token length would take
# seconds per launch, so the CPU tests check at the short length and a second one that is not a power of two.
LENGTHS = (vision_rotary.CHECK_TOKENS[0], 77)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(fused.ENV, raising=False)
    monkeypatch.setattr(vision_rotary, "_KERNEL", None)  # built afresh, as an interpreted function


def toward_zero(x):
    """fp32 -> bf16 rounded toward zero, as Triton's interpreter casts."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def fp32_expression(x, cos, sin):
    half = x.shape[-1] // 2
    x = x.float()
    return x * cos.float().unsqueeze(-2) + torch.cat((-x[..., half:], x[..., :half]), -1) * sin.float().unsqueeze(-2)


@pytest.mark.parametrize("tokens, heads, head_dim", [(201, 16, 80), (37, 3, 64), (5, 2, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equals_transformers_bit_for_bit(interpreter, tokens, heads, head_dim, dtype):
    inputs = vision_rotary.check_inputs(tokens, heads, head_dim, dtype, "cpu", seed=tokens)
    got, expected = vision_rotary.rotary(*inputs, reference=reference), reference(*inputs)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape and a.is_contiguous()
        assert torch.equal(a, b)


def test_bf16_is_the_fp32_expression_rounded_once(interpreter):
    query, key, cos, sin = vision_rotary.check_inputs(201, 16, 80, torch.bfloat16, "cpu")
    got = vision_rotary.rotary(query, key, cos, sin, reference=reference)
    for out, x in zip(got, (query, key)):
        assert torch.equal(out, toward_zero(fp32_expression(x, cos, sin)))
    # the same rounding of transformers' result differs from it in about half the elements: the check is sharp
    assert (got[0] != reference(query, key, cos, sin)[0]).float().mean() > 0.3


def test_transformers_function_where_a_gradient_is_needed_or_the_layout_differs(interpreter):
    calls = []

    def counted(*args):
        calls.append(args)
        return reference(*args)

    query, key, cos, sin = vision_rotary.check_inputs(9, 2, 8, torch.float32, "cpu")
    leaf = query.detach().requires_grad_()
    out, _ = vision_rotary.rotary(leaf, key, cos, sin, reference=counted)
    assert len(calls) == 1 and out.grad_fn is not None  # a LoRA adapter on the tower still trains
    with torch.no_grad():
        vision_rotary.rotary(leaf, key, cos, sin, reference=counted)
    assert len(calls) == 1  # no gradient: the kernel
    odd = vision_rotary.check_inputs(9, 2, 7, torch.float32, "cpu")
    assert not vision_rotary.fits(*odd)
    assert not vision_rotary.fits(query.transpose(0, 1), key.transpose(0, 1), cos, sin)  # heads first
    assert not vision_rotary.fits(query.to(torch.float64), key.to(torch.float64), cos, sin)
    assert not vision_rotary.fits(query[:, :, ::2], key[:, :, ::2], cos[:, :4], sin[:, :4])  # strided last dim
    vision_rotary.rotary(*odd, reference=counted)
    assert len(calls) == 2


def test_no_cuda_device_no_kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(fused.ENV, raising=False)
    query, key, cos, sin = vision_rotary.check_inputs(9, 2, 8, torch.float32, "cpu")
    assert not vision_rotary.fits(query, key, cos, sin)
    module = torch.nn.Module()
    module.num_heads, module.head_dim = 2, 8
    record = vision_rotary.select([(module, reference)], "cpu")
    assert record["implementation"] == "torch" and record["reason"] == "no CUDA device"


def attention_module(heads, head_dim):
    module = torch.nn.Module()
    module.num_heads, module.head_dim = heads, head_dim
    return module


def test_select_checks_every_head_shape_before_binding(interpreter):
    modules = [(attention_module(2, 8), reference), (attention_module(3, 64), reference),
               (attention_module(2, 8), reference)]
    record = vision_rotary.select(modules, "cpu", dtype=torch.float16, lengths=LENGTHS)
    assert record["implementation"] == "triton" and record["modules"] == 3
    checked = {(row["heads"], row["head_dim"], row["dtype"], row["tokens"]) for row in record["checks"]}
    assert checked == {(h, d, dtype, tokens) for h, d in [(2, 8), (3, 64)] for dtype in ("torch.float16", "torch.float32")
                       for tokens in LENGTHS}
    assert all(row["differing_elements"] == 0 for row in record["checks"])


def test_the_check_runs_in_the_towers_dtype():
    half = attention_module(2, 8)
    half.qkv = torch.nn.Linear(16, 48, dtype=torch.float16)
    assert vision_rotary.tower_dtype([(half, reference)]) == torch.float16
    assert vision_rotary.tower_dtype([(attention_module(2, 8), reference)]) == torch.bfloat16  # training's


def test_a_kernel_that_differs_is_an_error_naming_the_shape_and_the_switch(interpreter):
    def fused_multiply_add(q, k, cos, sin):  # one rounding fewer than transformers: a few last bits differ
        def one(x):
            x64 = x.double()
            half = x.shape[-1] // 2
            rotated = torch.cat((-x64[..., half:], x64[..., :half]), -1)
            return (x64 * cos.double().unsqueeze(-2) + rotated * sin.double().unsqueeze(-2)).to(x.dtype)
        return one(q), one(k)

    with pytest.raises(KernelCheckError) as error:
        vision_rotary.select([(attention_module(4, 16), fused_multiply_add)], "cpu", dtype=torch.float16,
                             lengths=LENGTHS)
    message = str(error.value)
    assert "x 4 heads x 16 in torch.float32" in message and f"{fused.ENV}=torch" in message


def test_the_switch_keeps_transformers_function(interpreter, monkeypatch):
    monkeypatch.setenv(fused.ENV, "torch")
    record = vision_rotary.select([(attention_module(2, 8), reference)], "cpu", "auto")
    assert record == {"requested": "torch", "modules": 1, "implementation": "torch", "checks": [],
                      "reason": "asked for"}
    monkeypatch.setenv(fused.ENV, "fastest")
    with pytest.raises(ConfigError, match=f"{fused.ENV}='fastest': choose one of auto, fla, torch"):
        vision_rotary.select([(attention_module(2, 8), reference)], "cpu")


def test_the_tiny_towers_output_is_unchanged_with_the_kernel_bound(interpreter, demo_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(demo_dir / "model", dtype=torch.float32).eval()
    visual = model.model.visual
    grids = torch.tensor([[2, 4, 6], [2, 4, 6]])
    patch = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size**2
    pixels = torch.randn(int(grids.prod(-1).sum()), patch, generator=torch.Generator().manual_seed(0))

    def tower():
        with torch.no_grad():
            output = visual(pixels, grid_thw=grids)
        return output.pooler_output if hasattr(output, "pooler_output") else output

    modules = vision_attention_modules(model)
    assert batch_vision_attention(model) == len(modules) == model.config.vision_config.depth
    expected = tower()
    assert vision_rotary.tower_dtype(modules) == torch.float32
    record = vision_rotary.select(modules, "cpu", lengths=LENGTHS)  # checked in the tower's dtype
    assert record["implementation"] == "triton" and {row["dtype"] for row in record["checks"]} == {"torch.float32"}
    batch_vision_attention(model, fused_rotary=True)
    assert all(module._rotary.func is vision_rotary.rotary for module, _ in modules)
    assert torch.equal(tower(), expected)
    batch_vision_attention(model, fused_rotary=False)  # and back to transformers' function
    assert all(module._rotary is reference for module, reference in modules)
