"""The typed program of ``tests/typed_usage.py`` runs: what ``mypy --strict`` accepts
there (``make lint``) is what the run time does."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_the_typed_program_runs() -> None:
    runpy.run_path(str(Path(__file__).with_name("typed_usage.py")), run_name="__main__")
