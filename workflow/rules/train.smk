rule train:
    """LoRA under DeepSpeed ZeRO-3 (one rank: without ZeRO), one process per device (resource nproc per node, 2 by default;
    resource nodes > 1 launches through Slurm's srun, one torchrun agent per node)."""
    message:
        announce("train: the LoRA fine-tune, {resources.nproc} rank(s) per node on {resources.nodes} node(s)")
    input:
        samples=rules.preprocess.output.manifest,
        probe=rules.probe.output.probe,
        model=config_path("model.path"),
        deepspeed=config_path("train.deepspeed_config"),
        after=rules.window.output.record,
        code=sources("train"),
    output:
        adapter=directory("results/train/adapter"),
        steps="results/train/steps.jsonl",
        record="results/train/run_record.json",
    params:
        job="train",
        cfg=stage_json("train"),
        data=data_fingerprint("model.path"),
        out=output_dir,
        launch=train_launcher,
    threads: 2
    resources:
        nproc=2,
        nodes=1,
    conda:
        ENV
    log:
        "logs/train/train.log",
    benchmark:
        "benchmarks/train/train.tsv"
    shell:
        "OMP_NUM_THREADS=$(( {threads} / {resources.nproc} > 0 ? {threads} / {resources.nproc} : 1 )) "
        "TRITON_CACHE_DIR=${{TRITON_CACHE_DIR:-$PWD/.cache/triton}} "
        "{params.launch} -m videosft.stages.train --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} "
        "--after {input.after} --samples {input.samples} --probe {input.probe} --out {params.out} > {log} 2>&1"
