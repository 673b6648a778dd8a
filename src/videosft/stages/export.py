"""Stage export: base + adapter merged into one checkpoint that loads anywhere without peft.

The base is loaded in ``export.dtype`` (bf16 by default), the adapter applied and merged
(``merge_and_unload``), and the result saved as sharded safetensors under the base's own key
layout, with the base's config unchanged and its processor, tokenizer, chat template and
generation files copied; ``from_pretrained`` loads it, and the predict stage takes it as
``model.path`` with ``predict.adapter: null``. ``export.json`` lists what was written.

    python -m videosft.stages.export --config config.yaml --adapter results/train/adapter --out results/export
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..models.checkpoint import companion_files, model_class
from ..data.adapter import check_readable
from ..provenance import existing_path, exit_after, run_record, stage_parser, write_json


def export(cfg: View, adapter: Path, out: Path) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    check_readable(adapter)
    model_dir = Path(cfg.model.path)
    dtype = getattr(torch, cfg.export.dtype)
    base = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=dtype)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, max_shard_size=cfg.export.max_shard_size)
    shutil.copy2(model_dir / "config.json", out / "config.json")  # unchanged, as the base had it
    copied = []
    for path in companion_files(model_dir):
        if not (out / path.name).exists() or path.name == "generation_config.json":
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    files = sorted(path.name for path in out.iterdir() if path.is_file())
    return {"model": str(model_dir), "adapter": str(adapter), "dtype": cfg.export.dtype, "files": files,
            "copied_from_base": copied, "parameters": sum(p.numel() for p in merged.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--adapter", type=existing_path, required=True, help="adapter directory from the train stage")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "export")
    with run_record("export", args.out, cfg, args) as record:
        record["results"] = export(cfg, args.adapter, args.out)
        write_json(args.out / "export.json", record["results"])
        print(f"export: {record['results']['parameters']:,} parameters ({cfg.export.dtype}) in {args.out}, "
              f"{len(record['results']['files'])} files")
    return 0


if __name__ == "__main__":
    exit_after(main)
