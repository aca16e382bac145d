"""``streampool profile``'s start-up hook (on the child's PYTHONPATH, never imported otherwise).

Wraps every device's resource in a LoggingResourceAdaptor writing to
``$STREAMPOOL_PROFILE_LOG`` (device N > 0 to ``.devN``), then runs the sitecustomize this
one shadows, if there is one. Child processes of the program are not profiled (the
variable is removed from the environment). When the adaptor cannot be installed, the
program does not run: exit status 127, with the reason on stderr.
"""

from __future__ import annotations

import os
import sys


def _install(log: str) -> None:
    import streampool
    from streampool import mr

    for device in range(streampool.device_count()):
        path = log if device == 0 else f"{log}.dev{device}"
        upstream = streampool.get_per_device_resource(device)
        streampool.set_per_device_resource(device, mr.LoggingResourceAdaptor(upstream, path))


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


# Popped: the program's own child processes would write over the same log.
_log = os.environ.pop("STREAMPOOL_PROFILE_LOG", None)
if _log:
    try:
        _install(_log)
    except Exception as e:
        # A program run without its log would be profiled for nothing: it does not start
        # (127, as a program that cannot be started), and says why.
        print(
            f"streampool profile: could not install the logging adaptor, so the program was not run: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(127)
    _chain()
