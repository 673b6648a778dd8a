"""The report's figures and tables of what the other stages did (the report stage draws them for
``snakemake --report report.html``): :mod:`.inputs` reads each stage's outputs through the module
that owns the file, one module draws each subject's figures (:mod:`.windows`, :mod:`.tokens`,
:mod:`.train_run`, :mod:`.evaluation`) with the helpers of :mod:`.drawing`, :mod:`.tables` writes
the evaluation's tables, and :func:`make_report` makes them all."""

from .figures import FIGURES, make_report
from .inputs import Inputs

__all__ = ["FIGURES", "Inputs", "make_report"]
