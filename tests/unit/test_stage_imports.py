"""No stage module imports another stage module: what stages share lives in library modules.

A stage that imports another reruns whenever that stage's code changes (its sources follow its
imports) and quietly depends on that stage's internals; contracts between stages (the sample store,
the adapter's file set) are library modules of their own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from videosft import provenance

PROJECT = Path(__file__).resolve().parents[2]
PACKAGE = provenance.PACKAGE_DIR


def stage_names() -> set[str]:
    """Every module the workflow runs as a stage: ``sources("X")`` and ``python -m videosft.X`` in its rules."""
    text = "\n".join(path.read_text() for path in sorted((PROJECT / "workflow" / "rules").glob("*.smk")))
    names = set(re.findall(r'sources\("(\w+)"\)', text)) | set(re.findall(r"-m videosft\.(\w+)", text))
    return {name for name in names if (PACKAGE / f"{name}.py").exists()}


def videosft_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every videosft module the file imports, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.append((node.lineno, node.module.split(".")[0]))
            elif node.level == 1:  # from . import x
                found += [(node.lineno, alias.name) for alias in node.names]
            elif node.module == "videosft":  # from videosft import x
                found += [(node.lineno, alias.name) for alias in node.names]
            elif node.module and node.module.startswith("videosft."):  # from videosft.x import y
                found.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.Import):  # import videosft.x
            found += [(node.lineno, alias.name.split(".")[1]) for alias in node.names
                      if alias.name.startswith("videosft.")]
    return found


def test_the_workflow_runs_the_stages_we_know():
    assert {"demo", "window", "preprocess", "probe", "train", "verify", "report", "predict", "export"} <= stage_names()


def test_no_stage_imports_another_stage():
    stages = stage_names()
    offending = [f"src/videosft/{stage}.py:{line} imports videosft.{module}"
                 for stage in sorted(stages)
                 for line, module in videosft_imports(PACKAGE / f"{stage}.py")
                 if module in stages and module != stage]
    assert not offending, ("a stage module imports another stage; move what they share into a library module: "
                           + "; ".join(offending))


def test_the_import_parser_sees_every_form(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("from .train import x\nfrom . import verify, config\nimport videosft.window\n"
                      "def f():\n    from videosft.preprocess import y\n    from videosft import probe\n")
    assert videosft_imports(source) == [(1, "train"), (2, "verify"), (2, "config"), (3, "window"),
                                        (5, "preprocess"), (6, "probe")]
