SHARDS = range(config["preprocess"]["shards"])


rule preprocess_shard:
    """Decode one shard of the windows under the token budget; chat, labels and pixels to Parquet."""
    message:
        announce("preprocess, shard {wildcards.shard}: frames under the token budget, chat, labels")
    input:
        windows=rules.window.output.windows,
        videos=config_path("data.root"),
        model=config_path("model.path"),
        after=rules.window.output.record,
        code=sources("preprocess"),
    output:
        shard=directory("results/preprocess/shards/{shard}"),
    params:
        job="preprocess_shard/{shard}",
        cfg=stage_json("preprocess"),
        data=data_fingerprint("data.root", "model.path"),
        shards=len(SHARDS),
    conda:
        ENV
    log:
        "logs/preprocess/shard-{shard}.log",
    benchmark:
        "benchmarks/preprocess/shard-{shard}.tsv"
    shell:
        "python -m videosft.stages.preprocess --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} --windows {input.windows} "
        "--shard {wildcards.shard} --shards {params.shards} --out {output.shard} > {log} 2>&1"


rule preprocess:
    """Join the shards into one manifest; count and check the rejects of all of them. Seconds of
    work: it runs where Snakemake runs, not as a cluster job that would wait in the queue."""
    localrule: True
    message:
        announce("preprocess: the shards joined into one manifest")
    input:
        shards=expand("results/preprocess/shards/{shard}", shard=SHARDS),
        after=rules.window.output.record,
        code=sources("preprocess"),
    output:
        manifest="results/preprocess/manifest.json",
        rejects="results/preprocess/rejects.jsonl",
        record="results/preprocess/run_record.json",
    params:
        job="preprocess",
        cfg=stage_json("preprocess"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/preprocess/preprocess.log",
    shell:
        "python -m videosft.stages.preprocess --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} --gather {input.shards} "
        "--out {params.out} > {log} 2>&1"
