"""The stages' entry points: one module per Snakemake rule, ``python -m videosft.stages.<name>``."""
