rule predict:
    """Cut lists for new videos (predict.videos): source-time ranges and editor timelines per video;
    for the val split (the default) also their evaluation in source time.
    Not part of the default target: `snakemake --cores 2 predict`; with report.source_time: true
    the default run predicts too and the report shows that evaluation (rule report)."""
    message:
        announce("predict: cut lists and editor timelines")
    input:
        unpack(predict_inputs),
        videos=new_videos(),
        model=config_path("model.path"),
        code=sources("predict"),
    output:
        summary="results/predict/summary.json",
        record="results/predict/run_record.json",
    params:
        job="predict",
        cfg=stage_json("predict"),
        data=data_fingerprint("model.path"),
        options=predict_options,
        out=output_dir,
    conda:
        ENV
    log:
        "logs/predict/predict.log",
    benchmark:
        "benchmarks/predict/predict.tsv"
    shell:
        "python -m videosft.stages.predict --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} {params.options} "
        "--out {params.out} > {log} 2>&1"


rule export:
    """Base + adapter merged into one checkpoint (sharded safetensors, processor files copied).
    Not part of the default target: `snakemake --cores 2 export`."""
    message:
        announce("export: base and adapter merged into one checkpoint")
    input:
        adapter=rules.train.output.adapter,
        model=config_path("model.path"),
        after=rules.window.output.record,
        code=sources("export"),
    output:
        export="results/export/export.json",
        record="results/export/run_record.json",
    params:
        job="export",
        cfg=stage_json("export"),
        data=data_fingerprint("model.path"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/export/export.log",
    benchmark:
        "benchmarks/export/export.tsv"
    shell:
        "python -m videosft.stages.export --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} "
        "--adapter {input.adapter} --out {params.out} > {log} 2>&1"
