"""Sharing a buffer with another process (IPC), through the driver's memory pools.

The exporting process allocates from a pool made for sharing,
``CudaAsyncMemoryResource(enable_ipc=True)`` (RMM's ``CudaAsyncMemoryResource`` has the same
argument), and exports a buffer: :func:`export` gives an :class:`IpcHandle`, which holds the
pool's POSIX file descriptor, 64 bytes that name the allocation in the pool, and the size.
The descriptor can only travel between processes over a Unix socket (``SCM_RIGHTS``):
:func:`send_handle` and :func:`recv_handle` do that, and a handle also pickles through
:mod:`multiprocessing` (its pipes, queues and process arguments pass descriptors the same
way; a queue pickles after ``put()`` has returned, so keep the handle open until the
receiver has it). Plain :mod:`pickle` refuses a handle (``TypeError``): its bytes cannot
carry the descriptor. The other process calls :func:`import_buffer` and gets a
:class:`~streampool.DeviceBuffer` over the same memory, at its own address.

The driver's rules, and what this module does about them:

* Only memory allocated directly from ``CudaAsyncMemoryResource(enable_ipc=True)`` can be
  shared; :func:`export` refuses anything else (another resource's memory, a suballocation
  of a pool) with an ``InvalidArgumentError`` naming that fix.
* The importer must not use the memory before it is ready: :func:`export` synchronises the
  buffer's stream (the one it was made on), so the allocation and every write enqueued on
  it before the export are done.
* The importer frees its buffer before the exporter frees the memory: close the imported
  buffer (it synchronises the device, then ``cuMemFree``: the driver does not wait for the
  work on pool memory), tell the exporter (over the same
  socket, say), and only then let the exporter drop its buffer. An import whose exporting
  process has exited is refused.
* A handle is imported in another process, never in the one that exported it.

On the simulated device (``STREAMPOOL_DEVICE=sim``, or ``streampool.sim.SimulatedDevice``)
the same code runs between two processes, each with its own simulated device: an
exportable pool keeps its memory in shared memory that the importer maps.

Examples, whole programs of two processes (a forked child over a socket pair, and
:mod:`multiprocessing` queues): ``docs/ipc.md``, whose code the test suite runs on the
simulated device. In short::

    exporting = mr.CudaAsyncMemoryResource(enable_ipc=True)
    buf = DeviceBuffer.to_device(b"hello", mr=exporting)
    with ipc.export(buf) as handle:
        ipc.send_handle(sock, handle)  # a Unix socket to the other process
    # the other process:
    with ipc.recv_handle(sock) as handle:
        imported = ipc.import_buffer(handle)
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from . import _native
from ._errors import InvalidArgumentError
from ._native import DeviceBuffer, IpcImportedMemoryResource

if TYPE_CHECKING:
    from ._native import _StreamLike

__all__ = [
    "IpcHandle",
    "IpcImportedMemoryResource",
    "export",
    "import_buffer",
    "recv_handle",
    "send_handle",
]

#: The size of the pointer export data (``CUmemPoolPtrExportData``).
EXPORT_DATA_BYTES = 64


class IpcHandle:
    """A buffer exported for another process (:func:`export`, :func:`recv_handle`).

    It owns its file descriptor (``fd``) and closes it on :meth:`close`, at the end of a
    ``with`` block, or when collected; the other fields are plain data (``nbytes`` is
    read-only: the import maps that many bytes). Importing does not consume the handle:
    close it once the descriptor is sent, or once imported. A ``multiprocessing.Queue``
    sends later, from a background thread: keep the handle open until the receiver has it.
    """

    __slots__ = ("__weakref__", "_fd", "_nbytes", "device", "export_data", "pid")

    def __init__(self, fd: int, export_data: bytes, nbytes: int, device: int, pid: int) -> None:
        _register_with_multiprocessing()
        self._fd = fd
        #: The 64 bytes of ``CUmemPoolPtrExportData`` that name the allocation in its pool.
        self.export_data = bytes(export_data)
        self._nbytes = nbytes
        #: The device ordinal in the exporting process.
        self.device = device
        #: The exporting process.
        self.pid = pid

    @property
    def nbytes(self) -> int:
        """Bytes shared (read-only)."""
        return self._nbytes

    @property
    def fd(self) -> int:
        """The pool's file descriptor (owned by the handle). InvalidArgumentError (a
        ValueError) once closed."""
        if self._fd < 0:
            raise InvalidArgumentError("this IpcHandle is closed: its file descriptor was closed")
        return self._fd

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has closed the descriptor."""
        return self._fd < 0

    def close(self) -> None:
        """Closes the file descriptor (memory already imported stays imported)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):  # closed behind the handle's back
            self.close()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Plain pickle (and anything else but multiprocessing's pickler, which takes
        # _reduce_for_multiprocessing below) would need multiprocessing's descriptor server
        # on the loading side: single use, only in a process of the same parent, failing
        # there late with errors that never name the handle. Refused at once instead.
        raise TypeError(
            "an IpcHandle holds a file descriptor, which plain pickle cannot carry to another "
            "process: send it with streampool.ipc.send_handle over a Unix socket, or through "
            "multiprocessing (a Pipe, a Queue, a Process argument), which passes descriptors; "
            "copy.copy(handle) duplicates it within a process"
        )

    def __copy__(self) -> IpcHandle:
        """A handle with a duplicate of the descriptor (closed independently)."""
        return IpcHandle(os.dup(self.fd), self.export_data, self.nbytes, self.device, self.pid)

    def __deepcopy__(self, memo: dict[int, object]) -> IpcHandle:
        return self.__copy__()

    def __repr__(self) -> str:
        fd = "closed" if self.closed else f"fd={self._fd}"
        return f"<IpcHandle {self.nbytes} bytes on device {self.device} from pid {self.pid}, {fd}>"


def _reduce_for_multiprocessing(handle: IpcHandle) -> tuple[Callable[..., IpcHandle], tuple[Any, ...]]:
    """How multiprocessing's pickler sends a handle (process arguments, pipes, queues): the
    descriptor travels as multiprocessing sends its own (SCM_RIGHTS); the receiving handle
    owns a duplicate."""
    from multiprocessing.reduction import DupFd

    if handle.closed:
        # Typically a multiprocessing.Queue: put() returns at once and a feeder thread
        # pickles later, after a `with` block has closed the handle. The error is printed by
        # that thread; the receiver's get() never returns.
        raise InvalidArgumentError(
            "this IpcHandle was closed before it was pickled: its file descriptor cannot be "
            "sent. A multiprocessing.Queue pickles after put() has returned, in a background "
            "thread: keep the handle open until the receiver has it (until it acknowledges), "
            "then close it"
        )
    return (_rebuild, (DupFd(handle.fd), handle.export_data, handle.nbytes, handle.device, handle.pid))


def _rebuild(dup: object, export_data: bytes, nbytes: int, device: int, pid: int) -> IpcHandle:
    return IpcHandle(dup.detach(), export_data, nbytes, device, pid)  # type: ignore[attr-defined]


_registered = False


def _register_with_multiprocessing() -> None:
    """Has multiprocessing's pickler send handles by :func:`_reduce_for_multiprocessing`.
    Done when the first handle is made, not at import: multiprocessing's pickler takes
    about 20 ms to import, half as much again as streampool."""
    global _registered
    if not _registered:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.register(IpcHandle, _reduce_for_multiprocessing)
        _registered = True


def export(buffer: DeviceBuffer) -> IpcHandle:
    """Exports ``buffer`` for another process: a new :class:`IpcHandle` (close it once sent).

    Synchronises the buffer's stream first (the one it was made on, whichever thread
    exports), so that the importer sees every write enqueued on it before the call. The buffer must come straight from
    ``CudaAsyncMemoryResource(enable_ipc=True)`` (or an adaptor over it that does not
    suballocate, such as the statistics adaptor); anything else raises InvalidArgumentError
    naming that fix. Keep the buffer alive until every importer has closed its import.
    """
    if not isinstance(buffer, DeviceBuffer):
        raise TypeError(f"buffer must be a streampool.DeviceBuffer, not {type(buffer).__qualname__}")
    fd, data, nbytes, device, pid = _native._ipc_export(buffer)
    return IpcHandle(fd, data, nbytes, device, pid)


def import_buffer(
    handle: IpcHandle, stream: _StreamLike = None, *, device: int | None = None
) -> DeviceBuffer:
    """The memory ``handle`` names (exported by another process) as a DeviceBuffer here.

    The buffer's ``mr`` is an :class:`IpcImportedMemoryResource`, which allocates nothing
    else; closing or collecting the buffer frees the import (``cuMemFree``). ``stream`` is
    the buffer's stream (default: the legacy default stream); ``device`` the device ordinal
    in this process (default: the exporter's, ``handle.device``: give it when the two
    processes number their devices differently, as with different CUDA_VISIBLE_DEVICES).
    The handle stays open: close it when done.
    """
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"handle must be a streampool.ipc.IpcHandle, not {type(handle).__qualname__}")
    if device is None:
        device = handle.device
        count = _native.device_count()
        if isinstance(device, int) and device >= count:
            has = f"the buffer was exported from the exporter's device {device}, and this process has "
            has += f"{count} device{'s' if count != 1 else ''}"
            if _native.using_simulated_device():
                # The simulator keeps an imported pool on the exporter's ordinal.
                raise InvalidArgumentError(
                    f"{has}: on the simulated device the importer needs that ordinal too, so give it "
                    f"at least {device + 1} devices (SimulatedDevice(devices=...) or "
                    "STREAMPOOL_SIM_DEVICES); device= cannot renumber there"
                )
            raise InvalidArgumentError(
                f"{has}: pass import_buffer(..., device=N), N being that GPU's ordinal here "
                "(processes number GPUs differently under different CUDA_VISIBLE_DEVICES)"
            )
    mr = IpcImportedMemoryResource(handle.fd, handle.export_data, handle.nbytes, handle.pid, device)
    return DeviceBuffer(size=handle.nbytes, stream=stream, mr=mr)


# The message send_handle sends with the descriptor: a tag, then nbytes, device, pid, the
# export data's length and the export data.
_TAG = b"streampool-ipc/1"
_HEADER = struct.Struct(f"!{len(_TAG)}sQiIH")
_MESSAGE_BYTES = _HEADER.size + EXPORT_DATA_BYTES


def _check_unix_socket(sock: socket.socket) -> None:
    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
        raise TypeError(
            "sock must be a connected Unix socket (socket.AF_UNIX, e.g. from socket.socketpair()): "
            f"file descriptors travel only over those, got {sock!r}"
        )


def send_handle(sock: socket.socket, handle: IpcHandle) -> None:
    """Sends ``handle`` (its descriptor by ``SCM_RIGHTS``) over a connected Unix socket.

    The handle keeps its own descriptor: close it afterwards. The peer calls :func:`recv_handle`.
    """
    _check_unix_socket(sock)
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"handle must be a streampool.ipc.IpcHandle, not {type(handle).__qualname__}")
    # What import_buffer checks, checked before anything is sent: the peer gets a handle
    # as it was made, or nothing.
    if len(handle.export_data) != EXPORT_DATA_BYTES:
        raise InvalidArgumentError(
            f"export_data must be the {EXPORT_DATA_BYTES} bytes the exporting driver gave, "
            f"not {len(handle.export_data)}"
        )
    for name, value, bits, signed in (
        ("nbytes", handle.nbytes, 64, False),
        ("device", handle.device, 32, True),
        ("pid", handle.pid, 32, False),
    ):
        low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        if not low <= value <= high:
            raise InvalidArgumentError(f"{name} must be from {low} to {high} to be sent, got {value}")
    header = _HEADER.pack(_TAG, handle.nbytes, handle.device, handle.pid, len(handle.export_data))
    message = header + handle.export_data
    socket.send_fds(sock, [message], [handle.fd])


def recv_handle(sock: socket.socket) -> IpcHandle:
    """Receives a handle that :func:`send_handle` sent on a connected Unix socket.

    The new handle owns the descriptor that came with it. Raises ConnectionError when the
    peer closed the socket first, and ValueError for a message that is not a handle. A
    message whose first bytes came with a descriptor is read to its end (a stream socket
    may split one), so a peer that sends such a message cut short and keeps the socket
    open makes this wait: give the socket a timeout (``sock.settimeout``) where that can
    happen.
    """
    _check_unix_socket(sock)
    message, fds, _flags, _addr = socket.recv_fds(sock, _MESSAGE_BYTES, 4)
    try:
        # A stream socket may split the message after its first bytes (the descriptor comes
        # with those); without a descriptor it is not a handle, whatever follows.
        while fds and len(message) < _MESSAGE_BYTES:
            more = sock.recv(_MESSAGE_BYTES - len(message))
            if not more:
                break
            message += more
        if not message:
            raise ConnectionError("the peer closed the socket before sending a handle")
        if len(fds) != 1 or len(message) != _MESSAGE_BYTES or not message.startswith(_TAG):
            raise ValueError(
                f"the message received is not a streampool IPC handle ({len(message)} bytes, "
                f"{len(fds)} file descriptors): send handles with streampool.ipc.send_handle"
            )
        _tag, nbytes, device, pid, length = _HEADER.unpack_from(message)
        data = message[_HEADER.size : _HEADER.size + min(length, EXPORT_DATA_BYTES)]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return IpcHandle(fds[0], data, nbytes, device, pid)
