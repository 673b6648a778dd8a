"""The fused vision rotary embedding on a GPU: the train stage's bit-for-bit check at a model's vision head
shape, then transformers' function and the kernel timed at a tower's sequence lengths.

    python bench/vision_rotary.py --model-config bench/configs/Qwen3.5-4B.json
    python bench/vision_rotary.py --model-config bench/configs/Qwen3.5-4B.json --tokens 48888 53760 --json out.json

The default lengths are the Qwen3.5-4B tower's patches in the benchmarks' steps: 48,888 in the profiled
16k-token pack of ``bench/packing.py`` and 53,760 at 128 frames (``bench/train_throughput.py``). Each row
also counts the elements where the two results differ at that length (0 is the only passing value).
Milliseconds per call are CUDA-event times after one untimed call (``videosft.kernels.checks``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from videosft.kernels import vision_rotary  # noqa: E402
from videosft.kernels.checks import milliseconds_per_call  # noqa: E402


def head_shape(model_config: Path) -> tuple[int, int]:
    vision = json.loads(model_config.read_text())["vision_config"]
    return vision["num_heads"], vision["hidden_size"] // vision["num_heads"]


def reference_function():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

    return apply_rotary_pos_emb_vision


def timings(heads: int, head_dim: int, lengths, dtype, device, repeats: int) -> list[dict]:
    reference = reference_function()
    rows = []
    for tokens in lengths:
        inputs = vision_rotary.check_inputs(tokens, heads, head_dim, dtype, device)
        torch_ms = milliseconds_per_call(lambda: reference(*inputs), device, repeats)
        fused_ms = milliseconds_per_call(lambda: vision_rotary.rotary(*inputs, reference=reference), device, repeats)
        rows.append({"tokens": tokens, "transformers_ms": torch_ms, "fused_ms": fused_ms, "speedup": torch_ms / fused_ms,
                     "differing_elements": vision_rotary.differing_elements(tokens, heads, head_dim, dtype, device,
                                                                            reference)})
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, required=True, help="a model's config.json (its vision_config)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[48888, 53760], help="sequence lengths to time")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=vision_rotary.DTYPES, default="bfloat16", help="q and k's, as training's")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the check rows and timings here")
    opts = parser.parse_args(argv)
    heads, head_dim = head_shape(opts.model_config)
    module = argparse.Namespace(num_heads=heads, head_dim=head_dim)
    # the train stage's own check: raises KernelCheckError on one differing element
    dtype = getattr(torch, opts.dtype)
    check = vision_rotary.select([(module, reference_function())], opts.device, dtype=dtype)
    if check["implementation"] != "triton":
        raise SystemExit(f"the kernel does not run here: {check.get('reason')}")
    rows = timings(heads, head_dim, opts.tokens, dtype, torch.device(opts.device), opts.repeats)
    print(f"check ({heads} heads x {head_dim}): " + ", ".join(
        f"{r['tokens']} tokens {r['dtype'].removeprefix('torch.')}: {r['differing_elements']} differing"
        for r in check["checks"]))
    print(f"{'tokens':>8} {'transformers ms':>16} {'fused ms':>9} {'speedup':>8} {'differing':>10}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['transformers_ms']:>16.3f} {r['fused_ms']:>9.3f} {r['speedup']:>7.1f}x "
              f"{r['differing_elements']:>10}")
    if opts.json:
        opts.json.write_text(json.dumps({"heads": heads, "head_dim": head_dim, "check": check, "timings": rows},
                                        indent=1))
    return 0 if all(r["differing_elements"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
