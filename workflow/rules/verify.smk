rule verify:
    """Reload base + adapter in a new process; compare every tensor; merged vs unmerged forwards."""
    message:
        announce("verify: the adapter reloaded and compared, base and fine-tune answering the val windows")
    input:
        adapter=rules.train.output.adapter,
        samples=rules.preprocess.output.manifest,
        model=config_path("model.path"),
        after=rules.window.output.record,
        code=sources("verify"),
    output:
        verify="results/verify/verify.json",
        record="results/verify/run_record.json",
    params:
        job="verify",
        cfg=stage_json("verify"),
        data=data_fingerprint("model.path"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/verify/verify.log",
    benchmark:
        "benchmarks/verify/verify.tsv"
    shell:
        "python -m videosft.stages.verify --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} --adapter {input.adapter} "
        "--samples {input.samples} --out {params.out} > {log} 2>&1"
