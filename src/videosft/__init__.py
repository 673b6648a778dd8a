"""videosft: LoRA fine-tuning of Qwen video-language models for temporal grounding, as a Snakemake pipeline."""

__version__ = "0.1.0"
