"""The embedded default: synthetic videos with known answers, and a tiny Qwen3.5 checkpoint.

Each video shows a moving background and a red ball that is visible during one or two
intervals; the ball's visible intervals are the video's keep ranges. The model is a
random-init ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``) with a byte-level
BPE tokenizer trained here, the Qwen special tokens, a ChatML template and the Qwen3-VL
processor, saved as a sharded safetensors checkpoint with an index, like a published one.

    python -m videosft.stages.demo --config config.yaml --out data/demo
"""

from __future__ import annotations

from .. import config as config_lib
from ..provenance import exit_after, run_record, stage_parser, write_json
from ..synthetic.model import build_model_dir
from ..synthetic.videos import make_videos


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "demo")
    with run_record("demo", args.out, cfg, args) as record:
        rows = make_videos(cfg.demo, args.out / "videos", args.out / "annotations.jsonl")
        model_facts = build_model_dir(cfg.demo, args.out / "model", cfg.prompt.system)
        record["results"] = {"videos": len(rows), "model": model_facts}
        write_json(args.out / "demo.json", record["results"])
    print(f"demo: {len(rows)} videos, model with {model_facts['parameters']} parameters in {args.out}")
    return 0


if __name__ == "__main__":
    exit_after(main)
