"""The stress harness: hundreds of concurrent forking sequences, every K/V read verified.

Library use::

    report = await run_stress(StressOptions(sequences=64, duration_s=10))
    assert report.ok, report.failures

Command line: ``akv stress`` (see :func:`register` and :func:`main_stress`) or
``python stress/run_stress.py``.
"""

from akv.stress.cli import add_arguments, main_stress, register
from akv.stress.options import StressOptions
from akv.stress.report import FaultInjection, StressReport
from akv.stress.runner import run_stress

__all__ = ["FaultInjection", "StressOptions", "StressReport", "add_arguments", "main_stress", "register", "run_stress"]
