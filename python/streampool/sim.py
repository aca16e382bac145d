"""The simulated device: run streampool without a GPU, and find stream-ordering races.

Host memory stands in for device memory, with a fixed capacity (so out-of-memory paths
are testable; by default what the host can give, at most 16 GiB). Streams are queues whose work runs only when told (:meth:`step`,
:meth:`run`) or when the host waits for it (``Stream.synchronize()``, blocking copies),
as on a GPU, where work runs later than it is enqueued. A happens-before race detector
reports every access to memory that is not ordered after the previous conflicting
access, naming both operations. The backlog is bounded as a GPU's queues are: a program
that never synchronises keeps at most 65,536 operations queued, beyond which the work
that may run does (:attr:`SimulatedDevice.ran_early` counts it, and races with work that
ran so are not reported; a chain of streams each waiting on the last gets there after
about 1,100 streams in flight).

Pointers on the simulated device are **host addresses**: the CUDA array interface and
DLPack carry them, for testing those protocols, but they are useless to real GPU
libraries (CuPy, PyTorch, Numba would read garbage or crash).

Example::

    import streampool
    from streampool.sim import SimulatedDevice

    with SimulatedDevice(capacity_bytes="1GiB") as dev:
        a, b = streampool.Stream(), streampool.Stream()
        buf = streampool.DeviceBuffer(size=4096, stream=a)
        dev.write(a, buf.ptr, 4096, label="producer")
        dev.read(b, buf.ptr, 4096, label="consumer")  # not ordered after the write
        dev.run()
        print(dev.races())

The environment variable ``STREAMPOOL_DEVICE=sim`` selects a simulated device for the
whole process instead.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from ._native import _SimDevice

__all__ = ["Race", "SimulatedDevice"]

#: What a ``stream`` argument may be: a ``streampool.Stream``, an int handle, None (the
#: legacy default stream), or another library's stream object.
StreamLike = Any


class Race(str):
    """A race the detector found: a ``str`` (the sentence naming both operations) with
    the details as attributes.

    Attributes:
        earlier: the access that ran first, e.g. ``"write 'producer' on stream 0x1000 (...)"``.
        earlier_writes: whether it wrote (else it read).
        later: the access that ran later and was not ordered after ``earlier``.
        later_writes: whether it wrote.
        start: first byte both touched.
        end: one past the last byte both touched.
    """

    earlier: str
    earlier_writes: bool
    later: str
    later_writes: bool
    start: int
    end: int

    def __new__(
        cls,
        text: str,
        earlier: str,
        earlier_writes: bool,
        later: str,
        later_writes: bool,
        start: int,
        end: int,
    ) -> Self:
        race = super().__new__(cls, text)
        race.earlier, race.earlier_writes = earlier, earlier_writes
        race.later, race.later_writes = later, later_writes
        race.start, race.end = start, end
        return race

    def __reduce__(self) -> tuple[type[Race], tuple[str, str, bool, str, bool, int, int]]:
        return (
            Race,
            (
                str(self),
                self.earlier,
                self.earlier_writes,
                self.later,
                self.later_writes,
                self.start,
                self.end,
            ),
        )


class SimulatedDevice:
    """A simulated CUDA device, active (what new streampool objects run on, process-wide)
    inside a ``with`` block.

    Only one simulated device may be active at a time: entering a second raises
    :class:`streampool.SimulatedDeviceActiveError`. Leaving the block closes the device:
    objects made under it are refused afterwards (their frees succeed silently). A device
    is entered once.

    Args:
        capacity_bytes: device memory, as an int or a string such as ``"1GiB"``. By default,
            what the host can give this process now (its available memory, and what
            ``ulimit -v`` leaves), at most 16 GiB: simulated memory is host memory, taken as
            it is allocated. A capacity beyond what the host gives is allowed; an allocation
            the host then refuses raises :class:`streampool.OutOfMemoryError` saying so.
        devices: how many devices (ordinals ``0..devices``, 1 to 1024), each of
            ``capacity_bytes``, with its own memory, pools and streams. Work on one device
            that touches another's memory needs access, as on GPUs: pool memory through
            ``peer_access`` on its ``CudaAsyncMemoryResource``, ``cudaMalloc`` memory through
            :func:`streampool.enable_peer_access`; copies between devices
            (``DeviceBuffer.copy_to_device``) need none. ValueError naming the value otherwise.
    """

    def __init__(self, capacity_bytes: int | str | None = None, devices: int = 1) -> None:
        if devices is None:  # the native constructor would take it for the default
            raise TypeError("devices must be a number of devices (an int from 1 to 1024), not None")
        self._dev = _SimDevice(capacity_bytes, devices)

    def __enter__(self) -> Self:
        self._dev.activate()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._dev.deactivate()

    def write(self, stream: StreamLike, ptr: int, nbytes: int | str, label: str | None = None) -> None:
        """Enqueues a simulated kernel on ``stream`` that writes ``[ptr, ptr + nbytes)``;
        ``label`` names it in race reports. It runs later (:meth:`step`, :meth:`run`, or a
        host synchronisation). ``ptr`` is a host address from this device. A default
        stream (``None``, the legacy or per-thread one) is that of the device whose memory
        ``ptr`` is."""
        self._dev.write(stream, ptr, nbytes, label)

    def read(self, stream: StreamLike, ptr: int, nbytes: int | str, label: str | None = None) -> None:
        """Enqueues a simulated kernel on ``stream`` that reads ``[ptr, ptr + nbytes)``;
        ``label`` names it in race reports."""
        self._dev.read(stream, ptr, nbytes, label)

    def step(self, stream: StreamLike) -> bool:
        """Runs the operation at the head of ``stream``'s queue if it may run now; False
        when the queue is empty or its head waits for work on other streams."""
        return self._dev.step(stream)

    def step_any(self) -> bool:
        """Runs one operation that may run now, taking streams in turn; False when none can."""
        return self._dev.step_any()

    def run(self) -> None:
        """Runs everything queued, streams in turn, until no stream has work. Ctrl-C
        (KeyboardInterrupt) stops it between two operations; what is left stays queued."""
        self._dev.run()

    def races(self) -> list[Race]:
        """The races found so far (each a ``str`` naming both operations, see :class:`Race`),
        in the order found. At most 1000 are kept: :attr:`races_dropped` counts the rest.
        Races with work that ran early are not found: see :attr:`ran_early`."""
        return [Race(*record) for record in self._dev.race_records()]

    @property
    def races_dropped(self) -> int:
        """Races found beyond the 1000 that :meth:`races` keeps, and so not reported
        (0 unless the cap was reached; :meth:`clear_races` resets it)."""
        return self._dev.races_dropped

    def clear_races(self) -> None:
        """Forgets the races found so far (for tests that provoke them on purpose)."""
        self._dev.clear_races()

    @property
    def pending(self) -> int:
        """Operations queued on all streams and not yet run."""
        return self._dev.pending

    @property
    def ran_early(self) -> int:
        """Operations run early because too much work waited unrun: a program that never
        synchronises keeps at most 65,536 operations queued (and their clocks, which grow
        with the streams in flight, at most two million entries); beyond, the work that may run
        does, streams in turn, until half of that is left, as a GPU's full queue makes a
        launch wait. Work queued afterwards is ordered after what ran, so a race between the
        two is not reported: above 0, the program queued more between synchronisations than
        the race detector follows. A chain of streams, each waiting on the last and none
        synchronised (a stream per task, handing memory on), reaches the bound on clock
        entries first: after about 1,100 streams in flight, a few thousand operations."""
        return self._dev.ran_early

    def queued(self, stream: StreamLike) -> int:
        """Operations queued on ``stream`` and not yet run."""
        return self._dev.queued(stream)

    def begin_capture(self, stream: StreamLike) -> None:
        """Begins capturing a CUDA graph on ``stream`` (``cuStreamBeginCapture``, the
        driver's global mode, PyTorch's default). Until :meth:`end_capture`, the calls a
        capture forbids fail as the driver's do and invalidate it: asking the stream's
        identity, querying or synchronising it, querying an event recorded in it, and, on
        any stream of the device, synchronous allocation, queries of other work and pool
        attributes. Work enqueued on the stream still runs (the simulated device has no
        graphs to launch): what is modelled is the driver's refusals, which is what an
        allocator must get right (docs/frameworks.md, "CUDA graphs")."""
        self._dev.begin_capture(stream)

    def end_capture(self, stream: StreamLike) -> None:
        """Ends ``stream``'s capture (``cuStreamEndCapture``); raises StreampoolError
        (``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``) when a forbidden call invalidated it."""
        self._dev.end_capture(stream)

    @property
    def capacity_bytes(self) -> int:
        """Device memory of each simulated device, in bytes."""
        return self._dev.capacity_bytes

    @property
    def active(self) -> bool:
        """True while this device is what new objects run on."""
        return self._dev.active

    @property
    def closed(self) -> bool:
        """True once the device has been exited."""
        return self._dev.closed

    def set_driver_version(self, version: int) -> None:
        """Makes the device report driver ``version`` (e.g. 12040 for CUDA 12.4) from now on,
        to test code that probes the driver: below 13000 it has no managed pools, and asking
        for one raises UnsupportedError as such a driver would. It reports 13000 until set."""
        self._dev.set_driver_version(version)

    def set_concurrent_managed_access(self, enabled: bool) -> None:
        """Makes the device report (or not) concurrent managed access from now on; without
        it there are no managed pools, and prefetches and advice naming a GPU (as preferred
        location or as accessed by) are refused, as the driver refuses them (Windows, WSL, some Jetson boards). It reports
        it until set."""
        self._dev.set_concurrent_managed_access(enabled)

    def set_peer_capable(self, a: int, b: int, capable: bool) -> None:
        """Makes devices ``a`` and ``b`` able (or not) to reach each other's memory from now
        on, as ``cuDeviceCanAccessPeer`` reports it both ways, to test code that meets GPUs
        without a peer path. Every pair of distinct devices can until told otherwise."""
        self._dev.set_peer_capable(a, b, capable)

    def describe(self) -> str:
        """E.g. ``"simulated device #3 (16 GiB)"``."""
        return self._dev.describe()

    def __repr__(self) -> str:
        state = "active" if self.active else "closed" if self.closed else "inactive"
        return f"<SimulatedDevice {self.describe()} {state}>"
