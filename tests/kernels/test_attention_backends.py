"""Which SDPA kernels training allows (videosft.kernels.attention_backends)."""

from __future__ import annotations

import pytest


def test_cudnn_attention_is_off_for_micro_batches_without_padding_and_left_on_for_padded_ones():
    import torch

    from videosft.kernels.attention_backends import for_batches

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        cuda = torch.device("cuda")  # the switch is process-wide state: no GPU needed to set it
        assert "cudnn" not in for_batches(cuda, padded=False)["sdpa_backends"]
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert "cudnn" in for_batches(cuda, padded=True)["sdpa_backends"]
        torch.backends.cuda.enable_cudnn_sdp(False)
        for_batches(torch.device("cpu"), padded=True)  # nothing to choose on a CPU
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_bucket_lengths_cover_the_sequence_waste_at_most_a_sixteenth_and_are_few():
    from videosft.kernels.attention_backends import MIN_BUCKET, bucket_length

    lengths = range(1, 40_000)
    buckets = {bucket_length(n) for n in lengths}
    for n in lengths:
        padded = bucket_length(n)
        assert n <= padded and padded % MIN_BUCKET == 0
        assert padded - n < max(MIN_BUCKET, n / 16 + 1)
        assert bucket_length(padded) == padded  # a bucket is its own bucket: no second copy
    assert len(buckets) <= 16 * 8  # 16 per power of two from 4,096 tokens up (plans are made per bucket)


@pytest.mark.parametrize("tokens", [1, 37, 256, 257, 700])
def test_causal_attention_padded_to_its_bucket_equals_it_unpadded_with_gradients(tokens):
    """Padding the sequence at its end is exact for causal attention: the outputs and the gradients of
    query, key and value at the real positions are those of the unpadded call (float32, CPU: only
    the blocking of sums may differ). Grouped key/value heads (4 query heads over 2) as in Qwen."""
    import torch

    from videosft.kernels.attention_backends import causal_sdpa

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    torch.manual_seed(tokens)
    shapes = [(1, 4, tokens, 16), (1, 2, tokens, 16), (1, 2, tokens, 16)]
    results = []
    for buckets in (False, True):
        inputs = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, shape in
                  enumerate(shapes)]
        output = causal_sdpa(module, *inputs, dropout=0.0, scaling=0.25, buckets=buckets)
        assert output.shape == (1, tokens, 4, 16)
        (output * torch.linspace(-1, 1, output.numel()).reshape(output.shape)).sum().backward()
        results.append([output.detach(), *(tensor.grad for tensor in inputs)])
    for padded, plain in zip(results[1], results[0]):
        torch.testing.assert_close(padded, plain, atol=1e-6, rtol=1e-5)
