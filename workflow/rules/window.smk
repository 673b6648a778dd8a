rule window:
    """Cut videos into windows, realign keep ranges into window time, split train/val by source video."""
    message:
        announce("window: windows of the annotated videos, keep ranges in window time, train and val by source video")
    input:
        annotations=config_path("data.annotations"),
        videos=config_path("data.root"),
        code=sources("window"),
    output:
        windows="results/window/windows.parquet",
        rejects="results/window/rejects.jsonl",
        record="results/window/run_record.json",
    params:
        job="window",
        cfg=stage_json("window"),
        data=data_fingerprint("data.annotations", "data.root"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/window/window.log",
    benchmark:
        "benchmarks/window/window.tsv"
    shell:
        "python -m videosft.stages.window --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --out {params.out} > {log} 2>&1"
