"""``profile``: runs a program unchanged with a logging adaptor as every device's resource.

The program runs in a child process whose ``PYTHONPATH`` starts with the directory of a
``sitecustomize`` shim (``_shim/``): at interpreter start-up it wraps every device's
current resource in a :class:`~streampool.mr.LoggingResourceAdaptor` writing to the log
(device 0 to ``LOG``, device N to ``LOG.devN``; the log is flushed line by line, so a
crash leaves every event up to it), then runs the program's own ``sitecustomize``, if any.
The program's output and exit status pass through. What it allocates through PyTorch,
CuPy or a resource it sets itself is not logged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SHIM = Path(__file__).with_name("_shim")
LOG_ENV = "STREAMPOOL_PROFILE_LOG"


def command_line(argv: Sequence[str]) -> list[str]:
    """The child's command: ``prog.py ARGS`` runs under this interpreter; anything else
    (``python prog.py``, ``python -m mod``, ``pytest ...``) as given."""
    if argv and argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return list(argv)


def run(argv: Sequence[str], log: str, simulated: bool) -> int:
    """Runs ``argv`` with the logging shim; returns its exit status (128 + N for a signal)."""
    env = dict(os.environ)
    env[LOG_ENV] = os.path.abspath(log)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [env.get("PYTHONPATH")])])
    if simulated:
        env["STREAMPOOL_DEVICE"] = "sim"
    Path(log).unlink(missing_ok=True)
    try:
        proc = subprocess.run(command_line(argv), env=env)
    except FileNotFoundError as e:
        print(f"streampool profile: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def logged_events(log: str) -> int:
    """The events in a log so far (its lines but the header)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return 0
