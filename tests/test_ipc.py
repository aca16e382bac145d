"""Sharing a buffer with another process (``streampool.ipc``).

The round trips run two real processes: this one exports, a child imports (on the
simulated device each process has its own, and the exported pool's memory is shared
memory; on a GPU, the driver's). The child reads what the parent wrote and writes back; the
parent reads that after the child has freed its import.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import queue
import socket
import subprocess
import sys
import textwrap
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest

import streampool
from streampool import DeviceBuffer, InvalidArgumentError, ipc, mr
from streampool.sim import SimulatedDevice

SIZE = 100_000
PARENT_BYTES = bytes(i % 251 for i in range(SIZE))
CHILD_BYTES = bytes((7 * i + 3) % 256 for i in range(SIZE))

# The importing process: receives a handle on the socket inherited as argv[1], checks the
# parent's bytes, writes its own, frees the import, says "done". With argv[2] == "sim" it
# runs on a simulated device of its own.
CHILD = textwrap.dedent(
    """
    import contextlib, socket, sys
    from streampool import ipc
    from streampool.sim import SimulatedDevice

    sock = socket.socket(fileno=int(sys.argv[1]))
    parent = bytes(i % 251 for i in range({size}))
    child = bytes((7 * i + 3) % 256 for i in range({size}))
    device = SimulatedDevice(capacity_bytes="64MiB") if sys.argv[2] == "sim" else contextlib.nullcontext()
    with device:
        with ipc.recv_handle(sock) as handle:
            buf = ipc.import_buffer(handle)
        assert buf.size == {size}, buf.size
        assert type(buf.mr).__name__ == "IpcImportedMemoryResource"
        assert buf.tobytes() == parent, "the exporter's bytes differ"
        buf.copy_from_host(child)
        buf.close()
        del buf  # and its resource: the imported pool is released
        import gc, streampool
        gc.collect()
        assert streampool.drop_errors()[0] == 0, streampool.drop_errors()
    sock.sendall(b"done")
    """
).format(size=SIZE)


def exchange(buf: DeviceBuffer, device: str, child_code: str = CHILD) -> None:
    """Exports ``buf`` to a child process running ``child_code`` (by default: checks it and
    writes ``CHILD_BYTES``), which answers "done"."""
    parent_end, child_end = socket.socketpair()
    parent_end.settimeout(120)  # a guard against a hung child, not a measurement
    with parent_end, child_end:
        child = subprocess.Popen(
            [sys.executable, "-c", child_code, str(child_end.fileno()), device],
            pass_fds=[child_end.fileno()],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            with ipc.export(buf) as handle:
                ipc.send_handle(parent_end, handle)
            answer = parent_end.recv(4)
        finally:
            _, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr
        assert answer == b"done"


def test_a_buffer_round_trips_between_two_processes() -> None:
    exporting = mr.CudaAsyncMemoryResource(enable_ipc=True)
    buf = DeviceBuffer(size=SIZE, mr=exporting)
    buf.copy_from_host(PARENT_BYTES)
    exchange(buf, "sim")
    assert buf.tobytes() == CHILD_BYTES
    # The pool is still usable, and exports again.
    again = DeviceBuffer(size=1000, mr=exporting)
    ipc.export(again).close()


# An importer that queues work on the memory and closes the import at once: close() must
# wait for that work (the driver's cuMemFree of pool memory does not, and the simulated
# device refuses a free with work on it queued), so that "done" means done.
CHILD_QUEUES_WORK = textwrap.dedent(
    """
    import socket, sys
    import streampool
    from streampool import ipc
    from streampool.sim import SimulatedDevice

    sock = socket.socket(fileno=int(sys.argv[1]))
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        with ipc.recv_handle(sock) as handle:
            buf = ipc.import_buffer(handle)
        s = streampool.Stream()
        for _ in range(3):
            dev.write(s, buf.ptr, buf.size, label="importer's kernel")
        assert dev.pending == 3, dev.pending
        buf.close()
        assert dev.pending == 0, dev.pending
        assert dev.races() == [], dev.races()
    sock.sendall(b"done")
    """
)


def test_closing_an_import_waits_for_the_work_queued_on_it() -> None:
    buf = DeviceBuffer(size=SIZE, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    exchange(buf, "sim", CHILD_QUEUES_WORK)


def _child_over_multiprocessing(handle: ipc.IpcHandle, conn: multiprocessing.connection.Connection) -> None:
    with SimulatedDevice(capacity_bytes="64MiB"), handle:
        buf = ipc.import_buffer(handle)
        conn.send(buf.tobytes()[:16])
        buf.copy_from_host(b"\xee" * 16)
        buf.close()
    conn.send("done")


@pytest.mark.skipif(
    sys.platform != "linux", reason="file descriptors through multiprocessing's spawn (Linux)"
)
def test_a_handle_pickles_through_multiprocessing() -> None:
    buf = DeviceBuffer.to_device(bytes(range(64)), mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with ipc.export(buf) as handle:
        child = ctx.Process(target=_child_over_multiprocessing, args=(handle, theirs))
        child.start()
    assert ours.poll(120)
    assert ours.recv() == bytes(range(16))
    assert ours.recv() == "done"
    child.join(120)
    assert child.exitcode == 0
    assert buf.tobytes()[:20] == b"\xee" * 16 + bytes(range(16, 20))


def test_a_copy_and_multiprocessings_pickle_give_a_handle_its_own_descriptor() -> None:
    from multiprocessing.reduction import ForkingPickler

    buf = DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    with ipc.export(buf) as handle:
        for make in (
            lambda: copy.copy(handle),
            lambda: copy.deepcopy(handle),
            lambda: ForkingPickler.loads(ForkingPickler.dumps(handle)),  # as a Pipe sends it
        ):
            with make() as other:
                assert other.fd != handle.fd
                assert (other.export_data, other.nbytes, other.device, other.pid) == (
                    handle.export_data,
                    handle.nbytes,
                    handle.device,
                    handle.pid,
                )
                assert os.fstat(other.fd).st_ino == os.fstat(handle.fd).st_ino
            assert not handle.closed  # closing the other closed its own descriptor only
            os.fstat(handle.fd)


def test_plain_pickle_refuses_a_handle_saying_how_to_send_it() -> None:
    buf = DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    with ipc.export(buf) as handle:
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            with pytest.raises(TypeError, match=r"plain pickle cannot carry .* streampool\.ipc\.send_handle"):
                pickle.dumps(handle, protocol)
        assert not handle.closed  # the handle is unchanged


def _importer_over_queues(handles: Any, replies: Any) -> None:
    with SimulatedDevice(capacity_bytes="64MiB"):
        with handles.get(timeout=120) as handle:
            buf = ipc.import_buffer(handle)
        replies.put("received")
        replies.put(buf.tobytes()[:16])
        buf.close()
    replies.put("done")


@pytest.mark.skipif(sys.platform != "linux", reason="file descriptors through multiprocessing (Linux)")
def test_a_handle_kept_open_until_the_receiver_has_it_goes_through_a_queue() -> None:
    buf = DeviceBuffer.to_device(bytes(range(64)), mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    ctx = multiprocessing.get_context("spawn")
    handles, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_importer_over_queues, args=(handles, replies))
    child.start()
    handle = ipc.export(buf)
    handles.put(handle)  # pickled later, by the queue's feeder thread
    assert replies.get(timeout=120) == "received"
    handle.close()
    assert replies.get(timeout=120) == bytes(range(16))
    assert replies.get(timeout=120) == "done"
    child.join(120)
    assert child.exitcode == 0


def test_a_handle_closed_before_a_queue_pickles_it_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """The documented mistake: ``with ipc.export(buf) as h: q.put(h)`` closes the handle
    before the queue's feeder thread pickles it. The feeder thread's error says so."""
    buf = DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    q: Any = multiprocessing.Queue()
    with ipc.export(buf) as handle:
        q.put(handle)
    with pytest.raises(queue.Empty):
        q.get(timeout=1)
    q.close()
    q.join_thread()  # the feeder thread has reported by now
    err = capsys.readouterr().err
    assert "InvalidArgumentError: this IpcHandle was closed before it was pickled" in err
    assert "keep the handle open until the receiver has it" in err
    with pytest.raises(
        InvalidArgumentError, match=r"multiprocessing\.Queue pickles after put\(\) has returned"
    ):
        ForkingPickler.dumps(handle)


def test_a_closed_handle_is_refused_with_invalid_argument_error() -> None:
    buf = DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    handle = ipc.export(buf)
    handle.close()
    assert handle.closed and "closed" in repr(handle)
    for call in (lambda: ipc.import_buffer(handle), lambda: handle.fd):
        with pytest.raises(InvalidArgumentError, match="this IpcHandle is closed") as raised:
            call()
        assert isinstance(raised.value, ValueError)  # `except ValueError` still catches it
    a, b = socket.socketpair()
    with a, b, pytest.raises(InvalidArgumentError, match="this IpcHandle is closed"):
        ipc.send_handle(a, handle)


def test_nbytes_is_read_only_and_pickles() -> None:
    buf = DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    with ipc.export(buf) as handle:
        assert handle.nbytes == 4096
        with pytest.raises(AttributeError):
            handle.nbytes = 1 << 30  # type: ignore[misc]
        assert handle.nbytes == 4096
        with ForkingPickler.loads(ForkingPickler.dumps(handle)) as received:
            assert received.nbytes == 4096


@pytest.mark.parametrize(
    "resource",
    [
        lambda: mr.CudaAsyncMemoryResource(),
        lambda: mr.CudaAsyncMemoryResource(release_threshold="1MiB"),
        lambda: mr.CudaMemoryResource(),
        lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(enable_ipc=True)),
        lambda: mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(enable_ipc=True), 10, 12),
    ],
    ids=["current-pool", "own-pool-without-ipc", "cuMemAlloc", "pool", "binning"],
)
def test_memory_that_cannot_be_shared_is_refused_naming_the_fix(resource) -> None:
    source = resource()
    buf = DeviceBuffer(size=4096, mr=source)
    # A suballocation is refused wherever it lies: the first at its chunk's start too.
    buf2 = DeviceBuffer(size=4096, mr=source)
    for b in (buf, buf2):
        with pytest.raises(InvalidArgumentError, match=r"CudaAsyncMemoryResource\(enable_ipc=True\)"):
            ipc.export(b)
    # The resource stays usable.
    buf.copy_from_host(b"x" * 4096)
    assert buf.tobytes() == b"x" * 4096


def test_an_adaptor_that_does_not_suballocate_exports() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource(enable_ipc=True))
    buf = DeviceBuffer(size=4096, mr=stats)
    ipc.export(buf).close()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match=r"buffer must be a streampool\.DeviceBuffer"):
        ipc.export(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"handle must be a streampool\.ipc\.IpcHandle"):
        ipc.import_buffer(42)  # type: ignore[arg-type]
    empty = DeviceBuffer(size=0, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    with pytest.raises(InvalidArgumentError, match="empty buffer"):
        ipc.export(empty)
    buf = DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    buf.close()
    with pytest.raises(ValueError):
        ipc.export(buf)


def _foreign_handle(**changes: object) -> ipc.IpcHandle:
    """A handle of this process's buffer that claims to come from another process (the
    parent, which is alive), with ``changes`` applied."""
    buf = DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    handle = ipc.export(buf)
    handle.pid = os.getppid()
    for name, value in changes.items():
        setattr(handle, name, value)
    return handle


def test_bad_handles_are_refused_and_the_resource_stays_usable() -> None:
    buf = DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    with ipc.export(buf) as handle, pytest.raises(InvalidArgumentError, match="exported by this process"):
        ipc.import_buffer(handle)
    with pytest.raises(ValueError, match="IpcHandle is closed"):
        ipc.import_buffer(handle)
    with (
        _foreign_handle(export_data=b"\0" * 63) as wrong,
        pytest.raises(InvalidArgumentError, match=r"must be the 64 bytes.*got 63"),
    ):
        ipc.import_buffer(wrong)
    wrong = _foreign_handle()
    os.close(wrong.fd)  # closed behind the handle's back
    with pytest.raises(InvalidArgumentError, match=f"fd {wrong.fd} is not an open file descriptor"):
        ipc.import_buffer(wrong)
    wrong._fd = -1
    with open(os.devnull, "rb") as devnull, _foreign_handle() as wrong:
        wrong._fd, devnull_fd = os.dup(devnull.fileno()), wrong.fd
        os.close(devnull_fd)
        with pytest.raises(streampool.CudaError, match="does not name a pool"):
            ipc.import_buffer(wrong)
    buf.copy_from_host(b"y" * 4096)
    assert buf.tobytes() == b"y" * 4096


# The importing process for the checks on what an importer may ask: a size beyond the
# allocation, bad device arguments, then a good import and its resource's repr.
CHECKING_CHILD = textwrap.dedent(
    """
    import socket, sys
    import pytest
    from streampool import InvalidArgumentError, ipc
    from streampool.sim import SimulatedDevice

    sock = socket.socket(fileno=int(sys.argv[1]))
    with SimulatedDevice(capacity_bytes="64MiB"), ipc.recv_handle(sock) as handle:
        nbytes = handle.nbytes
        handle._nbytes = 2 * nbytes
        with pytest.raises(InvalidArgumentError, match=f"says {2 * nbytes} bytes.*holds {nbytes}"):
            ipc.import_buffer(handle)
        handle._nbytes = nbytes
        for device, error in ((True, TypeError), ("0", TypeError), (-1, ValueError), (2**40, ValueError)):
            with pytest.raises(error, match="device must be a device ordinal"):
                ipc.import_buffer(handle, device=device)
        buf = ipc.import_buffer(handle)
        assert buf.tobytes() == bytes(range(256)) * (nbytes // 256)
        text = repr(buf.mr)
        assert text.startswith("<IpcImportedMemoryResource(device=0, ") and "in use" in text, text
        buf.close()
    sock.sendall(b"done")
    """
)


def test_an_importer_is_refused_more_bytes_than_were_exported_and_bad_devices() -> None:
    buf = DeviceBuffer.to_device(bytes(range(256)) * 16, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    neighbour = DeviceBuffer.to_device(b"n" * 4096, mr=buf.mr)
    exchange(buf, "sim", CHECKING_CHILD)
    assert neighbour.tobytes() == b"n" * 4096


@pytest.mark.nosim
def test_an_exporters_device_this_process_lacks_is_refused_with_the_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with SimulatedDevice(capacity_bytes="64MiB", devices=2):
        buf = DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(device=1, enable_ipc=True))
        handle = ipc.export(buf)
    with SimulatedDevice(capacity_bytes="64MiB"), handle:
        handle.pid = os.getppid()  # as if from another process: the device is checked first
        # The simulator keeps an imported pool on the exporter's ordinal: more devices, then.
        with pytest.raises(
            InvalidArgumentError,
            match=r"exporter's device 1, and this process has 1 device: on the simulated device "
            r"the importer needs that ordinal too, so give it at least 2 devices",
        ):
            ipc.import_buffer(handle)
        # A driver renumbers: device=N, the GPU's ordinal here.
        monkeypatch.setattr(streampool._native, "using_simulated_device", lambda: False)
        with pytest.raises(
            InvalidArgumentError, match=r"exporter's device 1.*pass import_buffer\(\.\.\., device=N\)"
        ):
            ipc.import_buffer(handle)


def test_an_exporter_that_has_exited_is_named() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)
    exited = rf"exporting process \(pid {pid}\) has exited"
    with _foreign_handle(pid=pid) as handle, pytest.raises(InvalidArgumentError, match=exited):
        ipc.import_buffer(handle)


def test_an_exporter_that_has_exited_but_is_not_yet_joined_is_named() -> None:
    # Between its exit and its parent's wait, the exporter is a zombie: it still has a pid
    # (kill(pid, 0) succeeds), but its memory is gone.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        state = ""
        for _ in range(3000):
            with open(f"/proc/{child.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.01)
        assert state == "Z"
        exited = rf"exporting process \(pid {child.pid}\) has exited"
        with _foreign_handle(pid=child.pid) as handle, pytest.raises(InvalidArgumentError, match=exited):
            ipc.import_buffer(handle)
    finally:
        child.wait()


def test_the_socket_helpers_refuse_what_is_not_a_handle() -> None:
    with socket.socket(socket.AF_INET) as inet, pytest.raises(TypeError, match="connected Unix socket"):
        ipc.recv_handle(inet)
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TypeError, match="handle must be"):
            ipc.send_handle(a, "handle")  # type: ignore[arg-type]
        a.sendall(b"not a handle")
        with pytest.raises(ValueError, match="not a streampool IPC handle"):
            ipc.recv_handle(b)
        a.close()
        with pytest.raises(ConnectionError, match="closed the socket"):
            ipc.recv_handle(b)


def test_the_imported_resource_allocates_nothing_else() -> None:
    # Import in a child so that the resource is a real import; the child reports.
    code = textwrap.dedent(
        """
        import socket, sys
        from streampool import DeviceBuffer, InvalidArgumentError, ipc, mr
        from streampool.sim import SimulatedDevice
        sock = socket.socket(fileno=int(sys.argv[1]))
        with SimulatedDevice(capacity_bytes="64MiB"), ipc.recv_handle(sock) as handle:
            buf = ipc.import_buffer(handle)
            try:
                DeviceBuffer(size=handle.nbytes, mr=buf.mr)
            except InvalidArgumentError as e:
                assert "cannot allocate" in str(e), e
            else:
                raise AssertionError("a second buffer from the imported resource")
            current = mr.get_current_device_resource()
            for wrapped in (buf.mr, mr.StatisticsResourceAdaptor(mr.LimitingResourceAdaptor(buf.mr, 1 << 20))):
                try:
                    mr.set_current_device_resource(wrapped)
                except ValueError as e:
                    assert "cannot be the resource of a device" in str(e), e
                else:
                    raise AssertionError("an imported resource became the device's resource")
            assert mr.get_current_device_resource() is current
            assert buf.tobytes() == b"z" * 512
            buf.close()
        sock.sendall(b"done")
        """
    )
    buf = DeviceBuffer.to_device(b"z" * 512, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    a, b = socket.socketpair()
    a.settimeout(120)
    with a, b:
        child = subprocess.Popen([sys.executable, "-c", code, str(b.fileno())], pass_fds=[b.fileno()])
        with ipc.export(buf) as handle:
            ipc.send_handle(a, handle)
        assert a.recv(4) == b"done"
        assert child.wait(120) == 0


# On a GPU: the importer's kernels on the memory are still running when it closes the
# import, and the exporter checks the data as soon as it hears "done" (before the importer
# exits, which would end its work too).
GPU_CHILD_KERNELS = textwrap.dedent(
    """
    import socket, sys
    import streampool
    from streampool import ipc, kernels

    sock = socket.socket(fileno=int(sys.argv[1]))
    with ipc.recv_handle(sock) as handle:
        buf = ipc.import_buffer(handle)
    s = streampool.Stream()
    kernels.fill(buf.ptr, buf.size, 5, s)
    kernels.compute(buf.ptr, buf.size, s, iterations=1000)  # passes that leave it as filled
    buf.close()  # waits for the kernels: the driver's cuMemFree does not
    sock.sendall(b"done")
    sock.recv(2)  # stays alive until the exporter has checked
    """
)


@pytest.mark.gpu
def test_gpu_closing_an_import_waits_for_its_kernels() -> None:
    if not streampool.device_info()["posix_fd_ipc"]:
        pytest.skip("this GPU's pools cannot be exported through POSIX file descriptors")
    from streampool import kernels

    size = 64 << 20
    buf = DeviceBuffer(size=size, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    a, b = socket.socketpair()
    a.settimeout(120)
    with a, b:
        child = subprocess.Popen(
            [sys.executable, "-c", GPU_CHILD_KERNELS, str(b.fileno())], pass_fds=[b.fileno()]
        )
        with ipc.export(buf) as handle:
            ipc.send_handle(a, handle)
        assert a.recv(4) == b"done"
        mismatches = kernels.check(buf.ptr, size, 5, streampool.Stream())
        a.sendall(b"ok")
        assert child.wait(120) == 0
    assert mismatches == 0


@pytest.mark.gpu
def test_gpu_a_buffer_round_trips_between_two_processes() -> None:
    if not streampool.device_info()["posix_fd_ipc"]:
        pytest.skip("this GPU's pools cannot be exported through POSIX file descriptors")
    exporting = mr.CudaAsyncMemoryResource(enable_ipc=True)
    stream = streampool.Stream()
    buf = DeviceBuffer(size=SIZE, stream=stream, mr=exporting)
    buf.copy_from_host(PARENT_BYTES)
    exchange(buf, "gpu")
    assert buf.tobytes() == CHILD_BYTES
    with pytest.raises(InvalidArgumentError, match=r"CudaAsyncMemoryResource\(enable_ipc=True\)"):
        ipc.export(DeviceBuffer(size=SIZE, mr=mr.CudaAsyncMemoryResource()))
    with ipc.export(buf) as handle, pytest.raises(InvalidArgumentError, match="exported by this process"):
        ipc.import_buffer(handle)


def test_an_export_from_another_thread_synchronises_the_stream_the_buffer_was_made_on(
    sim: SimulatedDevice,
) -> None:
    # A buffer made on one thread's per-thread default stream, exported from another: the
    # export waits for that stream (the exporting thread's own per-thread stream is another).
    import threading

    pool = mr.CudaAsyncMemoryResource(enable_ipc=True)
    made: list[DeviceBuffer] = []

    def maker() -> None:
        buf = DeviceBuffer(size=4096, stream=streampool.PER_THREAD_DEFAULT_STREAM, mr=pool)
        sim.write(streampool.PER_THREAD_DEFAULT_STREAM, buf.ptr, 4096, label="the maker's kernel")
        made.append(buf)

    thread = threading.Thread(target=maker)
    thread.start()
    thread.join()
    assert sim.pending >= 1
    with ipc.export(made[0]):
        assert sim.pending == 0, "the maker's write must be complete before the handle exists"


def test_an_import_outliving_its_simulated_device_closes_silently() -> None:
    # As every buffer of a closed simulated device does: nothing left to order or free.
    code = textwrap.dedent(
        """
        import gc, socket, sys
        import streampool
        from streampool import ipc
        from streampool.sim import SimulatedDevice
        sock = socket.socket(fileno=int(sys.argv[1]))
        with SimulatedDevice(capacity_bytes="64MiB"):
            with ipc.recv_handle(sock) as handle:
                buf = ipc.import_buffer(handle)
        buf.close()
        del buf
        gc.collect()
        assert streampool.drop_errors()[0] == 0, streampool.drop_errors()
        sock.sendall(b"done")
        """
    )
    exchange(
        DeviceBuffer.to_device(PARENT_BYTES, mr=mr.CudaAsyncMemoryResource(enable_ipc=True)), "sim", code
    )


def test_an_imported_buffer_is_not_exported_again() -> None:
    code = textwrap.dedent(
        """
        import socket, sys
        from streampool import InvalidArgumentError, ipc
        from streampool.sim import SimulatedDevice
        sock = socket.socket(fileno=int(sys.argv[1]))
        with SimulatedDevice(capacity_bytes="64MiB"), ipc.recv_handle(sock) as handle:
            buf = ipc.import_buffer(handle)
            try:
                ipc.export(buf)
            except InvalidArgumentError as e:
                assert "imported from another process and cannot be exported again" in str(e), e
                assert "copy.copy(handle)" in str(e), e
            else:
                raise AssertionError("an imported buffer was exported")
            buf.close()
        sock.sendall(b"done")
        """
    )
    exchange(
        DeviceBuffer.to_device(PARENT_BYTES, mr=mr.CudaAsyncMemoryResource(enable_ipc=True)), "sim", code
    )


def test_send_handle_refuses_what_a_handle_cannot_carry() -> None:
    buf = DeviceBuffer.to_device(b"x" * 4096, mr=mr.CudaAsyncMemoryResource(enable_ipc=True))
    a, b = socket.socketpair()
    with a, b, ipc.export(buf) as good:
        bad = [
            (dict(export_data=good.export_data + b"more"), "export_data must be the 64 bytes"),
            (dict(export_data=good.export_data[:10]), "export_data must be the 64 bytes"),
            (dict(device=2**31), "device must be from"),
            (dict(pid=2**32), "pid must be from"),
            (dict(pid=-1), "pid must be from"),
        ]
        for change, words in bad:
            fields: dict[str, Any] = dict(
                export_data=good.export_data, nbytes=good.nbytes, device=good.device, pid=good.pid
            )
            fields.update(change)
            with (
                ipc.IpcHandle(os.dup(good.fd), **fields) as handle,
                pytest.raises(InvalidArgumentError, match=words),
            ):
                ipc.send_handle(a, handle)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # nothing was sent


# Imports two buffers of one exported pool (two imports of the pool), closes the first
# import and collects its resource (which destroys its imported pool), then reads the
# second: the second import's pool must not go with the first.
TWO_IMPORTS = textwrap.dedent(
    """
    import contextlib, gc, socket, sys
    import streampool
    from streampool import ipc
    from streampool.sim import SimulatedDevice
    sock = socket.socket(fileno=int(sys.argv[1]))
    device = SimulatedDevice(capacity_bytes="64MiB") if sys.argv[2] == "sim" else contextlib.nullcontext()
    with device:
        with ipc.recv_handle(sock) as first_handle, ipc.recv_handle(sock) as second_handle:
            first = ipc.import_buffer(first_handle)
            second = ipc.import_buffer(second_handle)
        assert first.tobytes() == b"A" * 4096 and second.tobytes() == b"B" * 4096
        first.close()
        del first
        gc.collect()
        assert second.tobytes() == b"B" * 4096, "the second import went with the first"
        second.copy_from_host(b"C" * 4096)
        second.close()
        del second
        gc.collect()
        assert streampool.drop_errors()[0] == 0, streampool.drop_errors()
    sock.sendall(b"done")
    """
)


def two_imports(device: str) -> None:
    """Two buffers of one pool exported to a child that imports both (the driver gives the
    second import of a pool the first's handle), closes the first, then uses the second."""
    pool = mr.CudaAsyncMemoryResource(enable_ipc=True)
    first = DeviceBuffer.to_device(b"A" * 4096, mr=pool)
    second = DeviceBuffer.to_device(b"B" * 4096, mr=pool)
    a, b = socket.socketpair()
    a.settimeout(60)
    with a:
        with b:
            child = subprocess.Popen(
                [sys.executable, "-c", TWO_IMPORTS, str(b.fileno()), device],
                pass_fds=[b.fileno()],
                stderr=subprocess.PIPE,
            )
        for buf in (first, second):  # b closed here: the child's end alone is left
            with ipc.export(buf) as handle:
                ipc.send_handle(a, handle)
        answer = a.recv(4)
        _, stderr = child.communicate(timeout=60)
    assert child.returncode == 0 and answer == b"done", stderr.decode()
    assert second.tobytes() == b"C" * 4096 and first.tobytes() == b"A" * 4096


def test_two_imports_of_one_pool_are_independent() -> None:
    two_imports("sim")


@pytest.mark.gpu
def test_gpu_two_imports_of_one_pool_are_independent() -> None:
    if not streampool.device_info()["posix_fd_ipc"]:
        pytest.skip("this GPU's pools cannot be exported through POSIX file descriptors")
    two_imports("gpu")
