rule probe:
    """Checkpoint keys, shapes and dtypes against the model built on the meta device."""
    input:
        model=config["model"]["path"],
        samples=rules.preprocess.output.manifest,
        deepspeed=config["train"]["deepspeed_config"],
        code=sources("probe"),
    output:
        probe="results/probe/probe.json",
        record="results/probe/run_record.json",
    params:
        cfg=stage_json("probe"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/probe/probe.log",
    shell:
        "python -m videosft.probe --config {params.cfg:q} --code {input.code} --samples {input.samples} "
        "--out {params.out} > {log} 2>&1"
