rule preprocess:
    """Decode each window under the token budget; chat, labels and pixels to Parquet."""
    input:
        windows=rules.window.output.windows,
        videos=config["data"]["root"],
        model=config["model"]["path"],
        code=sources("preprocess"),
    output:
        train="results/preprocess/train.parquet",
        val="results/preprocess/val.parquet",
        rejects="results/preprocess/rejects.jsonl",
        record="results/preprocess/run_record.json",
    params:
        cfg=stage_json("preprocess"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/preprocess/preprocess.log",
    benchmark:
        "benchmarks/preprocess/preprocess.tsv"
    shell:
        "python -m videosft.preprocess --config {params.cfg:q} --code {input.code} --windows {input.windows} "
        "--out {params.out} > {log} 2>&1"
