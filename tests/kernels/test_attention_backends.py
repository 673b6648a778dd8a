"""Which SDPA kernels training allows (videosft.kernels.attention_backends)."""

from __future__ import annotations


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
