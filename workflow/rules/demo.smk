rule demo:
    """Synthetic videos with known keep ranges and a tiny random-init Qwen3.5 checkpoint."""
    message:
        announce("demo: the embedded default's videos, annotations and tiny model")
    input:
        code=sources("demo"),
    output:
        videos=directory("data/demo/videos"),
        annotations="data/demo/annotations.jsonl",
        model=directory("data/demo/model"),
        summary="data/demo/demo.json",
        record="data/demo/run_record.json",
    params:
        job="demo",
        cfg=stage_json("demo"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/demo/demo.log",
    benchmark:
        "benchmarks/demo/demo.tsv"
    shell:
        "python -m videosft.stages.demo --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --out {params.out} > {log} 2>&1"
