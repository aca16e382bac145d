"""``streampool profile``'s start-up hook (on the child's PYTHONPATH, never imported otherwise).

Claims the log ``$STREAMPOOL_PROFILE_LOG`` (creates it, only if no other process of the
program has), then tells the extension: from then on, each device's initial resource, as
the device is first used (from Python or through the C entry points PyTorch calls), is
the driver's pool under a logging adaptor writing to the log (device N > 0 to
``.devN``). Nothing touches the device at start-up, so a program that forks before its
first use works as it does unprofiled. Then runs the sitecustomize this one shadows, if
there is one (that one also without a log).

Unless ``$STREAMPOOL_PROFILE_FRAMEWORKS`` is ``0``, PyTorch, CuPy and Numba allocate
through that resource too, each routed as the program imports it (PyTorch at its first
CUDA initialisation; ``streampool.allocators._on_import``); what each routing did goes, a
line each, to the file ``$STREAMPOOL_PROFILE_NOTES``, which profile reads once the program
has exited (with a last line for CuPy or Numba where the program set its own allocator after).

Child processes of the program are not profiled: the variable is removed from the
environment and this directory from ``PYTHONPATH``, for the programs it starts, which
start as they would unprofiled (their own sitecustomize runs, and their children's). A
command that starts several Pythons itself (a shell script, a launcher) has its first
Python profiled, which claims the log; another finds the log claimed, runs unprofiled
and says so on stderr. A child forked from the program (``os.fork``, multiprocessing's
``fork`` start method) is not profiled either: the log is forgotten in it (a child of a
parent that had used the device cannot use it; one of a parent that had not gets
unlogged resources). When the log cannot be claimed for another reason, or streampool
cannot be imported, the program does not run: exit status 127, with the reason on
stderr in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any


def _claim(log: str) -> bool:
    """Creates ``log``; False when it exists: another Python of the program has it."""
    try:
        os.close(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    return True


def _install(log: str, frameworks: bool, notes: str | None) -> None:
    from streampool import _native

    _native._set_profile_log(log)
    if not frameworks:
        os.register_at_fork(after_in_child=lambda: _native._set_profile_log(None))
        return
    from streampool.allocators import _on_import

    routed: set[str] = set()

    def note(library: str, done: str) -> None:
        """Tells profile what routing ``library`` did (a line of the notes file)."""
        if not _on_import.kept_own(done):
            routed.add(library)
        if notes is None or _on_import._STOPPED.is_set():
            return
        line = " ".join(done.split())  # one line
        with contextlib.suppress(OSError), open(notes, "a", encoding="utf-8") as f:
            f.write(f"{library}\t{line}\n")

    # What the program can set after routing, in place of streampool's: the library, its
    # setting now, streampool's, and what the setting is.
    replaceable: list[tuple[str, Callable[[], Any], Callable[[], Any], str]] = [
        (
            "CuPy",
            lambda: sys.modules["cupy"].cuda.get_allocator(),
            lambda: sys.modules["streampool.allocators.cupy"].streampool_cupy_allocator,
            "allocator (cupy.cuda.set_allocator)",
        ),
        (
            "Numba",
            lambda: sys.modules["numba.cuda.cudadrv.driver"]._memory_manager,
            lambda: sys.modules["streampool.allocators.numba"].StreampoolNumbaManager,
            "memory manager (numba.cuda.set_memory_manager)",
        ),
    ]

    def check_replaced() -> None:
        """At exit: a program that set its own CuPy allocator or Numba memory manager after
        the library was routed (PyTorch refuses a second swap)."""
        for library, current, ours, what in replaceable:
            with contextlib.suppress(Exception):  # a module not loaded: nothing to check
                setting = current()
                if library in routed and setting is not None and setting is not ours():
                    note(
                        library,
                        f"replaced: the program set its own {what} after {library} was routed, and "
                        "what that allocated is not logged",
                    )

    def forget() -> None:  # a forked child runs unprofiled: no log, no more routing
        _native._set_profile_log(None)
        _on_import.stop()

    os.register_at_fork(after_in_child=forget)
    atexit.register(check_replaced)
    _on_import.route_on_import(note)


def _leave_pythonpath() -> None:
    """Takes this directory out of ``PYTHONPATH`` (profile put it first, before what was
    there), leaving the variable as it was before profile, unset if it was unset or empty."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    for i, entry in enumerate(entries):
        if entry and os.path.abspath(entry) == here:
            del entries[i]
            break
    else:
        return
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        del os.environ["PYTHONPATH"]


def _chain() -> None:
    """Imports the sitecustomize that this one shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        if me is not None:  # the import system looks this module up once it has run
            sys.modules["sitecustomize"] = me


# Popped, and the shim taken off PYTHONPATH: the program's own child processes would
# write over the same log; they run unprofiled, as they would without profile.
_log = os.environ.pop("STREAMPOOL_PROFILE_LOG", None)
_frameworks = os.environ.pop("STREAMPOOL_PROFILE_FRAMEWORKS", "1") != "0"
_notes = os.environ.pop("STREAMPOOL_PROFILE_NOTES", None)
_leave_pythonpath()
if _log:
    try:
        if _claim(_log):
            _install(_log, _frameworks, _notes)
        else:
            print(
                f"streampool profile: process {os.getpid()} is not profiled: another Python process "
                f"of the program writes the log {_log}",
                file=sys.stderr,
                flush=True,
            )
    except Exception as e:
        # A program run without its log would be profiled for nothing: it does not start
        # (127, as a program that cannot be started), and says why; the log it claimed
        # goes, so that profile adds nothing to this one line.
        with contextlib.suppress(OSError):
            os.unlink(_log)
        print(
            f"streampool profile: could not install the logging adaptor, so the program was not run: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(127)
_chain()
