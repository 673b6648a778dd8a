"""The package's layout holds: stages are entry points that nothing imports, each part of the
package imports only parts on its own layer or below it, and no function grows past what a reader
takes in at once.

A stage that imports another reruns whenever that stage's code changes (its sources follow its
imports) and quietly depends on that stage's internals; what stages share lives in library
modules (the sample store, the adapter's file set, the training parts). Tests and benchmarks
likewise use library modules, and call a stage only through its ``main``, as the workflow does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from videosft import provenance

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = provenance.PACKAGE_DIR
STAGES = PACKAGE / provenance.STAGES
LONGEST_FUNCTION = 60  # lines, decorators and docstring included
LONGEST_STAGE = {"train": 300}  # the train stage is its named phases; its parts live in videosft.training
# The package's parts from the ground up: a part uses parts on its own layer or below, never above,
# so that reading one part never needs a part that builds on it.
LAYERS = (
    {"errors", "progress", "stage_logs"},
    {"config", "provenance", "models"},
    {"media", "kernels"},
    {"data"},  # the files stages hand each other
    {"encoding"},  # what a window becomes for the model
    {"training", "synthetic"},
    {"evaluation"},
    {"reporting"},
    {provenance.STAGES},
)


def stage_names() -> set[str]:
    """Every module the workflow runs as a stage: ``sources("X")`` and ``-m videosft.stages.X`` in its rules."""
    text = "\n".join(path.read_text() for path in sorted((PROJECT / "workflow" / "rules").glob("*.smk")))
    return set(re.findall(r'sources\("(\w+)"\)', text)) | set(re.findall(r"-m videosft\.stages\.(\w+)", text))


def imports(path: Path, module: str | None) -> list[tuple[int, str, list[str]]]:
    """(line, dotted module inside videosft, names taken from it) for every videosft import of the file;
    ``module``: the file's own dotted name inside videosft, None outside the package."""
    return provenance.imports(path, module.split(".")[:-1] if module else [])


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) == 2 and parts[0] == provenance.STAGES else None


def used_attributes(path: Path, alias: str) -> set[str]:
    """The attributes a file reads from a name (``alias.x``)."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == alias}


def test_the_workflow_runs_every_stage_module_and_only_those():
    modules = {path.stem for path in STAGES.glob("*.py") if path.stem != "__init__"}
    assert stage_names() == modules == {"demo", "window", "preprocess", "probe", "train", "verify", "report",
                                        "predict", "export"}


def test_no_stage_imports_another_stage():
    offending = [f"src/videosft/stages/{path.name}:{line} imports videosft.{module}"
                 for path in sorted(STAGES.glob("*.py"))
                 for line, module, _ in imports(path, f"{provenance.STAGES}.{path.stem}")
                 if stage_of(module) and stage_of(module) != path.stem]
    library = [f"src/videosft/{path.relative_to(PACKAGE)}:{line} imports videosft.{module}"
               for path in sorted(PACKAGE.rglob("*.py")) if path.parent != STAGES
               for line, module, _ in imports(path, ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
               if stage_of(module)]
    assert not offending + library, ("only the workflow runs a stage; move what is shared into a library module: "
                                     + "; ".join(offending + library))


def layer_of(module: str) -> int:
    part = module.split(".")[0]
    found = [index for index, layer in enumerate(LAYERS) if part in layer]
    assert found, f"videosft.{part} is on no layer of LAYERS: add it where it stands"
    return found[0]


def upward_imports(path: Path, module: str) -> list[str]:
    """Each import of ``path`` (dotted ``module`` inside videosft) from a part on a higher layer than its own."""
    return sorted({f"{path.name}:{line} ({module.split('.')[0]}) imports videosft.{target}"
                   for line, target, _ in imports(path, module) if layer_of(target) > layer_of(module)})


def test_every_part_imports_only_its_own_layer_or_below():
    upward = [row for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "__init__.py"
              for row in upward_imports(path, ".".join(path.relative_to(PACKAGE).with_suffix("").parts))]
    assert not upward, ("move the definition down to the part that needs it, or the importing code up: "
                        + "; ".join(upward))


def test_the_layer_check_finds_an_import_from_above(tmp_path):
    source = tmp_path / "budget.py"
    source.write_text("from ..errors import Rejected\nfrom ..encoding.chat import IGNORE_INDEX\n"
                      "def f():\n    from videosft.evaluation.generation import prompt_of\n")
    assert upward_imports(source, "media.budget") == ["budget.py:2 (media) imports videosft.encoding.chat",
                                                      "budget.py:4 (media) imports videosft.evaluation.generation"]


def outside_files() -> list[Path]:
    return sorted([*(PROJECT / "tests").rglob("*.py"), *(PROJECT / "bench").rglob("*.py")])


@pytest.mark.parametrize("path", outside_files(), ids=lambda path: str(path.relative_to(PROJECT)))
def test_tests_and_benchmarks_call_a_stage_only_through_main(path):
    bad = []
    for line, module, names in imports(path, None):
        stage = stage_of(module)
        if not stage:
            continue
        taken = set(names) - {"main"}
        if "*" in taken:  # the module itself: only its main may be used
            alias = stage
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    alias = next((a.asname or a.name for a in node.names if a.name == stage and a.asname), alias)
            taken = used_attributes(path, alias) - {"main", "__doc__", "__name__", "__file__"}
        if taken:
            bad.append(f"line {line}: videosft.{module}.{', '.join(sorted(taken))}")
    assert not bad, f"{path.name} reaches into a stage's internals (use the library module they live in): {bad}"


def long_functions() -> list[str]:
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > LONGEST_FUNCTION:
                    rows.append(f"src/videosft/{path.relative_to(PACKAGE)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - start + 1} lines)")
    return rows


def test_no_function_is_longer_than_a_screen():
    assert not long_functions(), f"split into named steps (at most {LONGEST_FUNCTION} lines): {long_functions()}"


@pytest.mark.parametrize("stage,limit", sorted(LONGEST_STAGE.items()))
def test_the_train_stage_is_its_phases(stage, limit):
    lines = len((STAGES / f"{stage}.py").read_text().splitlines())
    assert lines <= limit, f"src/videosft/stages/{stage}.py has {lines} lines (at most {limit})"


def test_the_import_reader_sees_every_form(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("from ..stages.train import x\nfrom .. import config\nimport videosft.stages.window\n"
                      "def f():\n    from videosft.stages.preprocess import main\n    from videosft.stages import probe\n")
    assert [(line, module) for line, module, _ in imports(source, "training.example")] == [
        (1, "stages.train"), (2, "config"), (3, "stages.window"), (5, "stages.preprocess"), (6, "stages.probe")]
    assert imports(source, "training.example")[0][2] == ["x"] and imports(source, "training.example")[3][2] == ["main"]
