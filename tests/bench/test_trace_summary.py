"""bench/trace_summary.py on a hand-made timeline whose answer is known."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import trace_summary  # noqa: E402


def kernel(name: str, start: float, duration: float, stream: int, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": duration,
            "args": {"stream": stream, "correlation": correlation}}


def timeline() -> list[dict]:
    """Compute kernels at 0-100 and 400-500 us (a 300 us gap, while the host ran `slow_host_op`)
    and 500-520 us; a gather 50-150 us, half of it under compute."""
    return [
        {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "main"}},
        kernel("gemm", 0, 100, 7, 1),
        kernel("ncclDevKernel_AllGather", 50, 100, 17, 2),
        kernel("gemm", 400, 100, 7, 3),
        kernel("add", 500, 20, 7, 4),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 395, "dur": 4, "tid": 2,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 90, "dur": 320, "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": "slow_host_op", "ts": 110, "dur": 280, "tid": 2},
    ]


def test_busy_idle_and_who_the_device_waited_for(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": timeline()}, handle)
    summary = trace_summary.summarize(trace_summary.load_events(path), minimum_gap_us=20)
    assert summary["span_ms"] == pytest.approx(0.52)
    assert summary["streams"]["7"] == {"busy_ms": pytest.approx(0.22), "role": "compute"}
    assert summary["streams"]["17"]["role"] == "collectives"
    assert summary["streams"]["17"]["hidden_under_compute_ms"] == pytest.approx(0.05)
    assert summary["compute_idle_ms"] == pytest.approx(0.30)
    assert summary["idle_gaps"]["count"] == 1
    assert summary["idle_by_launching_thread_ms"] == {"main": pytest.approx(0.30)}
    assert summary["idle_by_host_operator_ms"] == {"slow_host_op": pytest.approx(0.30)}
    assert summary["idle_by_host_stack_ms"] == {"slow_host_op < outer": pytest.approx(0.30)}


def test_a_trace_without_device_work_is_refused():
    with pytest.raises(ValueError, match="taken on CPU"):
        trace_summary.summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "tid": 1}])


def test_the_compute_streams_time_by_kind_of_work():
    """Tensor-core products, fp32 ones on CUDA cores, attention, the Gated-DeltaNet, copies: each its own."""
    names = {"nvjet_sm90_tst_256x160_64x4_2x1_v_bz_coopA_TNT": 40,
             "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8_stage3": 7,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 20,
             "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": 12, "causal_conv1d_bwd_kernel": 3,
             "swiglu_fwdbwd_kernel": 5, "rotary_kernel": 2,
             "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::": 6,
             "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add": 4,
             "mystery_kernel": 1}
    events, start = [], 0.0
    for correlation, (name, duration) in enumerate(names.items()):
        events.append(kernel(name, start, duration, 7, correlation))
        start += duration
    events.append(kernel("ncclDevKernel_AllGather", 0, 50, 17, 99))  # another stream's: not compute time
    summary = trace_summary.summarize(events)
    assert summary["compute_ms_by_kind"] == {
        "matrix products": pytest.approx(0.040), "attention": pytest.approx(0.020),
        "Gated-DeltaNet and its convolution": pytest.approx(0.015),
        "elementwise, reductions and copies": pytest.approx(0.010), "matrix products, fp32": pytest.approx(0.007),
        "fused norms and activations": pytest.approx(0.005), "vision rotary embedding, fused": pytest.approx(0.002),
        "other": pytest.approx(0.001)}
    assert sum(summary["compute_ms_by_kind"].values()) == pytest.approx(summary["streams"]["7"]["busy_ms"])
    assert list(summary["compute_ms_by_kernel"])[0] == "nvjet_sm90_tst_256x160_64x4_2x1_v_bz_coopA_TNT"
