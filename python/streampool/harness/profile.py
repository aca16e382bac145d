"""``profile``: runs a program unchanged with a logging adaptor as every device's resource.

The program runs in a child process whose ``PYTHONPATH`` starts with the directory of a
``sitecustomize`` shim (``_shim/``): at interpreter start-up it claims the log and has each
device's initial resource made, as the device is first used, as the driver's pool under a
logging adaptor writing to the log (device 0 to ``LOG``, device N to ``LOG.devN``,
:func:`device_logs`; the log is flushed line by line, so a crash leaves every event up to
it), then runs the program's own ``sitecustomize``, if any.
The program's output and exit status pass through. Ctrl-C is the program's to handle: the
terminal sends SIGINT to the whole foreground process group, the program included, so
while it runs this process does not stop on SIGINT (:func:`wait`); it waits for the
program to exit, its clean-up logged too. SIGTERM, SIGHUP and SIGQUIT sent to this
process are sent on to the program, whose exit is awaited as well. PyTorch, CuPy and
Numba allocate through the logged resource, each routed as the program imports it
(``streampool.allocators._on_import``), unless ``frameworks`` is off. What it allocates
through RMM or a resource it sets itself is not logged. A log that cannot be written is refused
before the program runs (:func:`check_log`); should the shim still fail to install the
adaptor, it stops the program with status 127 (it could not start profiled).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._native import LOG_HEADER
from ..allocators._on_import import kept_own

SHIM = Path(__file__).with_name("_shim")
LOG_ENV = "STREAMPOOL_PROFILE_LOG"
FRAMEWORKS_ENV = "STREAMPOOL_PROFILE_FRAMEWORKS"
NOTES_ENV = "STREAMPOOL_PROFILE_NOTES"
#: The status of a program that could not start (the shell's): not found, not executable,
#: or the logging adaptor could not be installed in it.
CANNOT_START = 127


class CannotStartError(RuntimeError):
    """The program could not be started (its message says why, in one line)."""


def check_log(log: str) -> None:
    """Removes an old ``log`` (and the ``log.devN`` of an earlier run, so that they are not
    taken for this run's) and checks that a new one can be created (by creating and
    removing it), so that a program is never run for a log that cannot be written;
    OSError naming the log when it cannot. Only old logs are removed: a log that is
    anything else (``/dev/null``, a pipe, a link, a directory), a file this process may not
    write, or a file that is not an allocation log (a program's source named by mistake)
    is refused, never replaced."""
    path = Path(log)
    try:
        for _, old in _other_device_logs(log):
            if _a_file_to_replace(Path(old)):
                Path(old).unlink()
        if _a_file_to_replace(path):
            path.unlink()
        path.touch(exist_ok=False)
        path.unlink()
    except OSError as e:
        raise OSError(f"cannot write the log {log}: {e.strerror or e}") from None


#: The first line of an allocation log, which an old log that may be replaced starts with.
_HEADER = LOG_HEADER.encode()


def _a_file_to_replace(path: Path) -> bool:
    """True for a file this process may write (an old log), False where there is nothing;
    OSError for anything else, which a log must not replace."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise OSError(
            0, f"{path} is not a file (a device, a pipe, a link or a directory): give the path of a file"
        )
    if not os.access(path, os.W_OK):
        raise OSError(0, f"{path} is not writable (an old log is replaced only when it is)")
    with path.open("rb") as f:
        head = f.read(len(_HEADER) + 3).removeprefix(b"\xef\xbb\xbf")
    # An empty file, a log's header or the start of one (a run cut short): an old log.
    if head and not (head.startswith(_HEADER) or _HEADER.startswith(head)):
        raise OSError(
            0,
            f"{path} exists and is not an allocation log (its first line is not {LOG_HEADER!r}): "
            "name another log with -o, or remove the file",
        )
    return True


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


def log_device(log: str) -> int:
    """The device a profile's log is of: N for ``LOG.devN`` (:func:`device_logs`), else 0."""
    match = re.search(r"\.dev([0-9]+)$", log)
    return int(match.group(1)) if match else 0


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


#: An interpreter's name: ``python``, ``python3``, ``python3.12``, ``pythonw.exe``.
_PYTHON = re.compile(r"python[0-9.]*w?(\.exe)?", re.IGNORECASE)


def script(argv: Sequence[str]) -> str | None:
    """The Python script ``argv`` runs: ``prog.py`` of ``prog.py ARGS`` and of
    ``python [OPTIONS] prog.py ARGS`` (any interpreter: ``python3``, a path to one); None
    for anything else (``python -m mod``, ``python -c CODE``, another program)."""
    if not argv:
        return None
    if argv[0].endswith(".py"):
        return argv[0]
    if not (_PYTHON.fullmatch(os.path.basename(argv[0])) or argv[0] == sys.executable):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        option = argv[i]
        if option == "--":
            i += 1
            break
        if option.startswith("--"):
            return None  # --help, --version, ...: no script
        if option[1] in "XW":  # -X OPT, -W ARG, or -Xdev, -Wignore
            i += 1 if len(option) > 2 else 2
            continue
        if "m" in option or "c" in option:
            return None  # -m MOD, -c CODE (also as -um, -Bc): no script
        i += 1
    return argv[i] if i < len(argv) and argv[i] != "-" else None


def check_program(argv: Sequence[str], log: str | None = None) -> None:
    """CannotStartError, before anything is run or removed, when ``argv``'s command cannot
    be run (not found on ``PATH``, not a file, not executable); when it is a Python
    interpreter other than this one that cannot import streampool (``python`` on ``PATH``
    outside the virtual environment that has streampool: the shim would stop the program);
    when it runs a Python script (:func:`script`) that does not exist (the interpreter
    would start, say it cannot open the file and exit with status 2, which would read as
    the program's own failure), or that is ``log`` itself (which profile would replace
    with the log)."""
    command = command_line(argv)[0] if argv else ""
    found = command if os.sep in command else shutil.which(command)
    if found is None or not os.path.exists(found):
        raise CannotStartError(f"cannot run {command!r}: No such file or directory")
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise CannotStartError(f"cannot run {command!r}: Permission denied")
    path = script(argv)
    if path is not None:
        if not os.path.exists(path):
            raise CannotStartError(f"cannot run {path!r}: No such file or directory")
        if log is not None and os.path.exists(log) and os.path.samefile(path, log):
            raise CannotStartError(f"the log {log} is the program {path!r}: name another log with -o")
    if _PYTHON.fullmatch(os.path.basename(command)) and os.path.abspath(found) != sys.executable:
        _check_has_streampool(command, found)


def _check_has_streampool(command: str, found: str) -> None:
    """CannotStartError when the interpreter ``found`` (the program's) cannot import
    streampool, which the shim needs there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMPOOL_")}
    try:
        probe = subprocess.run(
            [found, "-c", "import streampool"], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise CannotStartError(f"cannot run {command!r}: {e}") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        raise CannotStartError(
            f"the program's Python, {command!r} ({found}), cannot import streampool ({last}), which "
            f"profile needs in it: install streampool there, name this Python instead "
            f"({sys.executable}), or give the script alone (-- prog.py ARGS), which runs under it"
        )


def run(
    argv: Sequence[str],
    log: str,
    simulated: bool,
    output_to_stderr: bool = False,
    frameworks: bool = True,
    notes: str | None = None,
) -> int:
    """Runs ``argv`` with the logging shim (the log checked first, :func:`check_log`);
    returns its exit status (128 + N for a signal). ``output_to_stderr``: the program's
    standard output goes to stderr (so that stdout holds a JSON document alone).
    ``frameworks``: PyTorch, CuPy and Numba allocate through the logged resource, each
    routed as the program imports it; ``notes``: a file that gets a line
    ``LIBRARY<tab>what was done`` for each (:func:`read_notes`). CannotStartError when the
    program cannot be started (not found, not executable, a Python script that does not
    exist: :func:`check_program`), before anything runs."""
    check_program(argv, log)
    check_log(log)
    env = dict(os.environ)
    env[LOG_ENV] = os.path.abspath(log)
    env[FRAMEWORKS_ENV] = "1" if frameworks else "0"
    env.pop(NOTES_ENV, None)
    if notes is not None:
        env[NOTES_ENV] = os.path.abspath(notes)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [env.get("PYTHONPATH")])])
    if simulated:
        env["STREAMPOOL_DEVICE"] = "sim"
    sys.stdout.flush()
    sys.stderr.flush()
    return wait(command_line(argv), env, sys.stderr if output_to_stderr else None)


#: Signals passed on to the program while it runs (those of them this platform has): a
#: stop asked of ``profile`` is asked of the program, which then stops (and cleans up) as
#: it would unprofiled, rather than being left running, orphaned.
FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


def wait(command: list[str], env: dict[str, str], stdout: Any = None) -> int:
    """Runs ``command`` and waits for it; its exit status (128 + N for a signal N).

    While it runs, SIGINT does not stop this process: a Ctrl-C at the terminal reaches
    the program too (the terminal signals the whole foreground process group), which
    handles it as it would unprofiled (a Python program cleans up after its
    KeyboardInterrupt, and what it frees then is logged), and its status passes through.
    A SIGINT sent to this process alone is not passed on. SIGTERM, SIGHUP and SIGQUIT
    (``FORWARDED``: a supervisor's stop, ``kill PID``, a closed terminal) do not stop this
    process either: each is sent on to the program, and this process keeps waiting for it
    to exit and passes its status on (143 for a program that SIGTERM stops). The signals
    are caught by handlers (SIGINT's does nothing), not ignored (an ignored signal would
    stay ignored in the program), from before the program starts to after it exits, when
    the previous handlers are put back; one that arrives before the program has started
    is sent to it once it has. Nothing changes for a signal ignored already (the program
    inherits that, as it would unprofiled), or from a thread other than the main one
    (which never receives signals). CannotStartError when the program cannot be started."""
    main = threading.current_thread() is threading.main_thread()
    caught = [s for s in (signal.SIGINT, *FORWARDED) if main and signal.getsignal(s) is not signal.SIG_IGN]
    started: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if started:
            with contextlib.suppress(OSError):  # it has just exited
                started[0].send_signal(signum)
        else:
            pending.append(signum)

    previous = {s: signal.signal(s, _interrupted if s == signal.SIGINT else forward) for s in caught}
    try:
        child = subprocess.Popen(command, env=env, stdout=stdout)
        started.append(child)
        for signum in pending:
            forward(signum, None)
        status = child.wait()
    except OSError as e:
        raise CannotStartError(f"cannot run {command[0]!r}: {e.strerror or e}") from None
    finally:
        for s, handler in previous.items():
            put_back(s, handler)
    return status if status >= 0 else 128 - status


def put_back(signum: int, handler: Any) -> None:
    """Puts ``handler`` back as ``signum``'s (what ``signal.signal`` returned). A handler set
    outside Python (None) cannot be put back: the default, then."""
    signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _interrupted(signum: int, frame: Any) -> None:
    """SIGINT while the program runs: the program has it too, and decides."""


def read_notes(notes: str) -> dict[str, str]:
    """What the shim said last of each library it routed (``{library: what was done}``, in
    the order the program imported them; a later line, such as CuPy's allocator replaced by
    the program, overrides an earlier one); empty when the file is missing."""
    try:
        with open(notes, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    said: dict[str, str] = {}
    for library, _, done in (line.partition("\t") for line in lines):
        if done:
            said[library] = done
    return said


def routed(notes: dict[str, str]) -> list[str]:
    """The libraries of ``notes`` (:func:`read_notes`) that allocated through streampool."""
    return [library for library, done in notes.items() if not kept_own(done)]


def logged_events(log: str) -> int:
    """The events in a log so far (its lines but the header)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return 0
