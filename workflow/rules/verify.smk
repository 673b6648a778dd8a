rule verify:
    """Reload base + adapter in a new process; compare every tensor; merged vs unmerged forwards."""
    input:
        adapter=rules.train.output.adapter,
        samples=rules.preprocess.output.manifest,
        model=config["model"]["path"],
        code=sources("verify"),
    output:
        verify="results/verify/verify.json",
        record="results/verify/run_record.json",
    params:
        cfg=stage_json("verify"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/verify/verify.log",
    benchmark:
        "benchmarks/verify/verify.tsv"
    shell:
        "python -m videosft.verify --config {params.cfg:q} --code {input.code} --adapter {input.adapter} "
        "--samples {input.samples} --out {params.out} > {log} 2>&1"
