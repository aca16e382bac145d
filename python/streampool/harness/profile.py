"""``profile``: runs a program unchanged with a logging adaptor as every device's resource.

The program runs in a child process whose ``PYTHONPATH`` starts with the directory of a
``sitecustomize`` shim (``_shim/``): at interpreter start-up it wraps every device's
current resource in a :class:`~streampool.mr.LoggingResourceAdaptor` writing to the log
(device 0 to ``LOG``, device N to ``LOG.devN``, :func:`device_logs`; the log is flushed
line by line, so a crash leaves every event up to it), then runs the program's own
``sitecustomize``, if any.
The program's output and exit status pass through. Ctrl-C is the program's to handle: the
terminal sends SIGINT to the whole foreground process group, the program included, so
while it runs this process does not stop on SIGINT (:func:`wait`); it waits for the
program to exit, its clean-up logged too. What it allocates through PyTorch,
CuPy or a resource it sets itself is not logged. A log that cannot be written is refused
before the program runs (:func:`check_log`); should the shim still fail to install the
adaptor, it stops the program with status 127 (it could not start profiled).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHIM = Path(__file__).with_name("_shim")
LOG_ENV = "STREAMPOOL_PROFILE_LOG"
#: The status of a program that could not start (the shell's): not found, not executable,
#: or the logging adaptor could not be installed in it.
CANNOT_START = 127


class CannotStartError(RuntimeError):
    """The program could not be started (its message says why, in one line)."""


def check_log(log: str) -> None:
    """Removes an old ``log`` (and the ``log.devN`` of an earlier run, so that they are not
    taken for this run's) and checks that a new one can be created (by creating and
    removing it), so that a program is never run for a log that cannot be written;
    OSError naming the log when it cannot."""
    path = Path(log)
    try:
        for _, old in _other_device_logs(log):
            Path(old).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        path.touch()
        path.unlink()
    except OSError as e:
        raise OSError(f"cannot write the log {log}: {e.strerror or e}") from None


def _other_device_logs(log: str) -> list[tuple[int, str]]:
    """``(N, "LOG.devN")`` for each log of a device N > 0 beside ``log``, by device."""
    path = Path(log)
    prefix = f"{path.name}.dev"
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    found = []
    for name in names:
        number = name[len(prefix) :]
        # "LOG.dev1", not "LOG.dev01" or "LOG.dev0" (device 0's log is LOG itself).
        if name.startswith(prefix) and number.isascii() and number.isdigit() and number[0] != "0":
            found.append((int(number), f"{log}.dev{number}"))
    return sorted(found)


def device_logs(log: str) -> list[tuple[int, str]]:
    """The logs of a profile, ``(device, path)`` by device: ``log`` for device 0, then the
    ``log.devN`` the program's other devices wrote (the shim makes one for every device)."""
    return [(0, log), *_other_device_logs(log)]


def command_line(argv: Sequence[str]) -> list[str]:
    """The child's command: ``prog.py ARGS`` runs under this interpreter; anything else
    (``python prog.py``, ``python -m mod``, ``pytest ...``) as given."""
    if argv and argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return list(argv)


def run(argv: Sequence[str], log: str, simulated: bool, output_to_stderr: bool = False) -> int:
    """Runs ``argv`` with the logging shim (the log checked first, :func:`check_log`);
    returns its exit status (128 + N for a signal). ``output_to_stderr``: the program's
    standard output goes to stderr (so that stdout holds a JSON document alone).
    CannotStartError when the program cannot be started (not found, not executable)."""
    check_log(log)
    env = dict(os.environ)
    env[LOG_ENV] = os.path.abspath(log)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [env.get("PYTHONPATH")])])
    if simulated:
        env["STREAMPOOL_DEVICE"] = "sim"
    sys.stdout.flush()
    sys.stderr.flush()
    return wait(command_line(argv), env, sys.stderr if output_to_stderr else None)


def wait(command: list[str], env: dict[str, str], stdout: Any = None) -> int:
    """Runs ``command`` and waits for it; its exit status (128 + N for a signal N).

    While it runs, SIGINT does not stop this process: a Ctrl-C at the terminal reaches
    the program too (the terminal signals the whole foreground process group), which
    handles it as it would unprofiled (a Python program cleans up after its
    KeyboardInterrupt, and what it frees then is logged), and its status passes through.
    A SIGINT sent to this process alone is not passed on. SIGINT is caught by a handler
    that does nothing, not ignored (an ignored signal would stay ignored in the program),
    from before the program starts to after it exits, when the previous handler is put
    back. Nothing changes where SIGINT is ignored already (the program inherits that, as it
    would unprofiled), or from a thread other than the main one (which never receives
    signals). CannotStartError when the program cannot be started."""
    catch = threading.current_thread() is threading.main_thread()
    catch = catch and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, _interrupted) if catch else None
    try:
        child = subprocess.Popen(command, env=env, stdout=stdout)
        status = child.wait()
    except OSError as e:
        raise CannotStartError(f"cannot run {command[0]!r}: {e.strerror or e}") from None
    finally:
        if catch:  # a handler set outside Python (None) cannot be put back: the default, then
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    return status if status >= 0 else 128 - status


def _interrupted(signum: int, frame: Any) -> None:
    """SIGINT while the program runs: the program has it too, and decides."""


def logged_events(log: str) -> int:
    """The events in a log so far (its lines but the header)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return 0
