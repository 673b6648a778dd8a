rule probe:
    """Checkpoint keys, shapes and dtypes against the model built on the meta device."""
    message:
        announce("probe: the checkpoint against the model on the meta device, and the memory plan")
    input:
        model=config_path("model.path"),
        samples=rules.preprocess.output.manifest,
        deepspeed=config_path("train.deepspeed_config"),
        after=rules.window.output.record,
        code=sources("probe"),
    output:
        probe="results/probe/probe.json",
        record="results/probe/run_record.json",
    params:
        job="probe",
        cfg=stage_json("probe"),
        data=data_fingerprint("model.path"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/probe/probe.log",
    shell:
        "python -m videosft.stages.probe --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} --samples {input.samples} "
        "--out {params.out} > {log} 2>&1"
