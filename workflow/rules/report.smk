report: "../report/workflow.rst"


rule report:
    """Figures of every stage's outputs; `snakemake --report report.html` embeds them.

    The evaluation table is the verify stage's, per window. With report.source_time: true the
    report also shows the predict stage's evaluation in source time (its merged cut lists of the
    val videos against the annotations) beside it: predict's summary becomes an input, so the
    default run then also predicts (predict.videos, the val split by default), and a change to
    predict reruns the report. Off (the default), predict stays out of the default run and the
    table says how to add it; predict on a folder of new videos has nothing to score, and the
    table says so. Seconds of work on small files: it runs where Snakemake runs, not as a cluster
    job that would wait in the queue."""
    localrule: True
    message:
        announce("report: figures and tables of every stage's outputs")
    input:
        unpack(report_inputs),
        windows=rules.window.output.windows,
        window_rejects=rules.window.output.rejects,
        manifest=rules.preprocess.output.manifest,
        preprocess_rejects=rules.preprocess.output.rejects,
        probe=rules.probe.output.probe,
        train=rules.train.output.record,
        train_steps=rules.train.output.steps,
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
            labels={"figure": "per window and in source time (chart)"},
        ),
        table=report(
            "results/report/evaluation.html",
            caption="../report/evaluation_table.rst",
            category="3. Evaluation",
            labels={"figure": "per window and in source time (tables, definitions, answers)"},
        ),
        csv="results/report/evaluation.csv",
        source_time_csv="results/report/evaluation_source_time.csv",
        record="results/report/run_record.json",
    params:
        job="report",
        cfg=stage_json("report"),
        out=output_dir,
        predict=report_options,
    conda:
        ENV
    log:
        "logs/report/report.log",
    benchmark:
        "benchmarks/report/report.tsv"
    shell:
        "python -m videosft.stages.report --config {params.cfg:q} --code {input.code} --job {params.job} --stage-log {log} --after {input.after} "
        "--windows {input.windows} --window-rejects {input.window_rejects} --manifest {input.manifest} "
        "--preprocess-rejects {input.preprocess_rejects} --probe {input.probe} --train {input.train} "
        "--train-steps {input.train_steps} --verify {input.verify} {params.predict} --out {params.out} > {log} 2>&1"
