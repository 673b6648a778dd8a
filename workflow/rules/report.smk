report: "../report/workflow.rst"


rule report:
    """Figures of every stage's outputs; `snakemake --report report.html` embeds them."""
    input:
        windows=rules.window.output.windows,
        window_rejects=rules.window.output.rejects,
        manifest=rules.preprocess.output.manifest,
        preprocess_rejects=rules.preprocess.output.rejects,
        probe=rules.probe.output.probe,
        train=rules.train.output.record,  # steps.rank*.jsonl are read beside it
        verify=rules.verify.output.verify,
        after=rules.window.output.record,
        code=sources("report"),
    output:
        windows=report(
            "results/report/windows.png",
            caption="../report/windows.rst",
            category="1. Data",
            labels={"figure": "windows per split and rejects per reason"},
        ),
        tokens=report(
            "results/report/tokens.png",
            caption="../report/tokens.rst",
            category="1. Data",
            labels={"figure": "frames and tokens per sample, token budget"},
        ),
        loss=report(
            "results/report/loss.png",
            caption="../report/loss.rst",
            category="2. Training",
            labels={"figure": "loss per rank"},
        ),
        memory=report(
            "results/report/memory.png",
            caption="../report/memory.rst",
            category="2. Training",
            labels={"figure": "peak memory per rank vs predicted"},
        ),
        load=report(
            "results/report/load.png",
            caption="../report/load.rst",
            category="2. Training",
            labels={"figure": "load and load-verification times"},
        ),
        evaluation=report(
            "results/report/evaluation.png",
            caption="../report/evaluation.rst",
            category="3. Evaluation",
            labels={"figure": "base vs fine-tuned (chart)"},
        ),
        table=report(
            "results/report/evaluation.html",
            caption="../report/evaluation_table.rst",
            category="3. Evaluation",
            labels={"figure": "base vs fine-tuned (table, answers)"},
        ),
        csv="results/report/evaluation.csv",
        record="results/report/run_record.json",
    params:
        job="report",
        cfg=stage_json("report"),
        out=output_dir,
    conda:
        ENV
    log:
        "logs/report/report.log",
    benchmark:
        "benchmarks/report/report.tsv"
    shell:
        "python -m videosft.report --config {params.cfg:q} --code {input.code} --job {params.job} --after {input.after} "
        "--windows {input.windows} --window-rejects {input.window_rejects} --manifest {input.manifest} "
        "--preprocess-rejects {input.preprocess_rejects} --probe {input.probe} --train {input.train} "
        "--verify {input.verify} --out {params.out} > {log} 2>&1"
