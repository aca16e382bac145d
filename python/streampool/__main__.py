"""``python -m streampool`` (and the ``streampool`` command): the environment report.

Which device streampool runs on, the driver, the GPU, what it supports, an allocate/free
round trip through every resource, and the recommended resource. On a machine without a
CUDA driver it says so and reports on the simulated device instead (of
``STREAMPOOL_SIM_CAPACITY`` and ``STREAMPOOL_SIM_DEVICES``, as the harness's); so does
``STREAMPOOL_DEVICE=sim``. A ``STREAMPOOL_DEVICE`` that names no backend, or a simulated
device's variable the library would refuse, is bad usage: one line, exit status 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from . import __version__, mr
from ._env import simulated_device, simulated_settings
from ._errors import CudaDriverNotFoundError, InvalidArgumentError, StreampoolError
from ._native import (
    Stream,
    backend_description,
    device_can_access_peer,
    device_count,
    device_info,
    driver_version,
    get_current_device,
    using_simulated_device,
)

DEFAULT = "CudaAsyncMemoryResource"
RESOURCES: dict[str, Callable[[], mr.MemoryResource]] = {
    "CudaAsyncMemoryResource": mr.CudaAsyncMemoryResource,
    "CudaMemoryResource": mr.CudaMemoryResource,
    "ManagedMemoryResource": mr.ManagedMemoryResource,
    "PinnedHostMemoryResource": mr.PinnedHostMemoryResource,
}
ROUND_TRIP_BYTES = 1 << 20
ROUND_TRIPS = 50


def _driver_missing_reason(error: BaseException) -> str:
    """The core's message without its prefix and its advice (the report gives both)."""
    text = str(error)
    text = text.removeprefix("no CUDA driver found: ")
    return text.split(". To run without a GPU")[0]


@contextlib.contextmanager
def _device() -> Iterator[list[str]]:
    """The device to report on, entered: the CUDA driver, else (said plainly) the simulated
    device, of ``STREAMPOOL_SIM_CAPACITY`` and ``STREAMPOOL_SIM_DEVICES``; gives the lines
    that say which. Before any line is printed, ValueError (bad usage) naming the variable
    when ``STREAMPOOL_DEVICE`` names no backend (the library's InvalidArgumentError: falling
    back to the simulated device would hide a typo) or a simulated device's variable holds
    a value the library refuses."""
    if using_simulated_device():
        # The library's own device, of the same variables: checked here as for the harness.
        simulated_settings()
        yield [f"Device:        {backend_description()} (selected by STREAMPOOL_DEVICE=sim)"]
        return
    try:
        description = backend_description()
    except CudaDriverNotFoundError as e:
        why = f"No CUDA driver found ({_driver_missing_reason(e)}): running on the simulated device."
    except InvalidArgumentError:
        raise  # STREAMPOOL_DEVICE names no backend: bad usage, not a driver to fall back from
    except StreampoolError as e:
        why = f"The CUDA driver is unusable ({e}): running on the simulated device."
    else:
        yield [f"Device:        {description}"]
        return
    with simulated_device() as dev:
        yield [why, f"Device:        {dev.describe()}"]


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        value /= 1024
    raise AssertionError("unreachable")


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def _round_trip(make: Callable[[], mr.MemoryResource]) -> str:
    """Allocate + free of 1 MiB on a new stream: "ok" and the median time, or the error."""
    try:
        resource = make()
        stream = Stream()
        times: list[float] = []
        for _ in range(ROUND_TRIPS + 1):
            start = time.perf_counter()
            ptr = resource.allocate(ROUND_TRIP_BYTES, stream)
            resource.deallocate(ptr, ROUND_TRIP_BYTES, stream)
            times.append(time.perf_counter() - start)
        stream.synchronize()
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"
    median_us = statistics.median(times[1:]) * 1e6  # the first includes warm-up
    return f"ok   {median_us:8.1f} us"


#: GPUs listed by name (a simulated device may have up to 1024).
MAX_LISTED = 16


def report(out: Callable[[str], None] = print) -> None:
    """Prints the environment report through ``out``."""
    with _device() as device_lines:
        out(f"streampool {__version__}: environment report")
        for line in device_lines:
            out(line)
        version = driver_version()
        simulated = using_simulated_device()
        modelled = ", as the simulated device reports it" if simulated else ""
        out(f"Driver:        CUDA {version // 1000}.{version % 1000 // 10} ({version}{modelled})")
        count = device_count()
        out(f"Devices:       {count}")
        if count > 1:
            pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
            missing = [f"{a}->{b}" for a, b in pairs if not device_can_access_peer(a, b)]
            out(f"Peer access:   {'between every pair' if not missing else 'none for ' + ', '.join(missing)}")
        current = get_current_device()
        info = device_info(current)
        # Every GPU by name and memory; what follows is the current one's.
        for d in range(min(count, MAX_LISTED)):
            d_info = info if d == current else device_info(d)
            mark = " (the current device)" if count > 1 and d == current else ""
            out(f"{f'GPU {d}:':<15}{d_info['name']}, {_human(d_info['total_bytes'])}{mark}")
        if count > MAX_LISTED:
            out(f"               ... and {count - MAX_LISTED} more")
        out(f"Memory pools:  {_yes(info['memory_pools'])}")
        out(f"Managed pools: {_yes(info['managed_pools'])}")
        out(f"Concurrent managed access: {_yes(info['concurrent_managed_access'])}")
        out(f"Pool IPC (POSIX file descriptors): {_yes(info['posix_fd_ipc'])}")
        out("")
        out(
            f"Resources: allocate + free of {_human(ROUND_TRIP_BYTES)} on a new stream (median of {ROUND_TRIPS})"
        )
        if simulated:
            out("  (on the simulated device these times measure the simulator, not a GPU)")
        width = max(map(len, RESOURCES))
        for name, make in RESOURCES.items():
            out(f"  {name:<{width}}  {_round_trip(make)}")
        out("")
        if info["memory_pools"]:
            out(
                f"Default:       {DEFAULT} (the driver's stream-ordered pool, shared with the async "
                "allocators of PyTorch and CuPy), the current resource of every device."
            )
        else:
            out(
                "Default:       none that fits: this device has no memory pools, so "
                f"{DEFAULT} (the usual default) cannot run here; CudaMemoryResource can."
            )
        out(
            "Which resource suits your program is a measurement, not this report: "
            "`streampool profile -o app.log -- python app.py`, then `streampool recommend app.log` "
            "replays its allocations on each candidate and recommends one "
            "(docs/choosing-a-resource.md has the figures of common workloads)."
        )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``streampool`` command: the environment report (``info``, the default) and the
    harness's commands (:mod:`streampool.harness.cli`)."""
    from .harness.cli import main as cli_main

    # Started with stdout or stderr closed (`>&-`), Python has None for it: what would
    # have been written there goes nowhere, as a write to a closed descriptor would.
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115  # for the whole process
    try:
        code = cli_main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # `streampool | head -1`: the reader stopped reading. Python flushes stdout again
        # at exit: pointing it at /dev/null keeps that flush from raising a second time
        # (the recipe of the `signal` module's documentation). For the environment
        # report, which was only writing, that is no failure: status 0. Any other command
        # stopped before its verdict: 141, a shell's status for a program that SIGPIPE
        # stopped, so that `set -o pipefail` does not read it as a pass.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0 if _is_report(sys.argv[1:] if argv is None else argv) else 128 + signal.SIGPIPE
    return code


def _is_report(argv: Sequence[str]) -> bool:
    """Whether the command line asks for the environment report (``info``, the default)."""
    words = [a for a in argv if not a.startswith("-")]
    return not words or words[0] == "info"


if __name__ == "__main__":
    sys.exit(main())
