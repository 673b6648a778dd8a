# videosft: LoRA fine-tuning of Qwen video-language models for temporal grounding.
#   snakemake --cores 2          the whole pipeline on the embedded default (CPU, offline)
#   snakemake --forcerun train   rerun one stage and what follows
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/demo.smk"
include: "workflow/rules/window.smk"
include: "workflow/rules/preprocess.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/verify.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/predict.smk"


rule all:
    default_target: True
    input:
        "results/verify/verify.json",
        "results/report/run_record.json",


onsuccess:
    show_finished_stages(log)


onerror:
    show_failed_stages(log)
