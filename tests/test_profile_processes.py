"""``streampool profile`` with programs of several processes, and the command line's own
output going nowhere: forks before the first use, a launcher starting several Pythons, a
Python that ignores PYTHONPATH, a log named like the program, a program allocating on
several devices, stdout closed or its reader gone (subprocesses on the simulated device)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import streampool

from .test_harness_cli import run

pytestmark = pytest.mark.nosim

ALLOCATE = """\
import sys, streampool
r, s = streampool.get_current_device_resource(), streampool.Stream()
for _ in range(int(sys.argv[1])):
    r.deallocate(r.allocate({size}, s), {size}, s)
"""


def sizes(log: Path) -> list[str]:
    return [line.split(",")[4] for line in log.read_text().splitlines()[1:]]


def profiled(
    tmp_path: Path, source: str, *args: str, python: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Writes ``source`` to prog.py and runs it (with ``args``, the interpreter given the
    options ``python``) under ``streampool profile -o app.log``: the run, and the log."""
    program, log = tmp_path / "prog.py", tmp_path / "app.log"
    program.write_text(source)
    return run("profile", "-o", str(log), "--", sys.executable, *python, str(program), *args), log


def test_a_program_that_forks_before_its_first_use_runs_as_unprofiled(tmp_path: Path) -> None:
    # The start-up hook touches no device: the fork children may use it, as unprofiled.
    out, log = profiled(
        tmp_path,
        "import multiprocessing, os, streampool\n"
        "def work(size):\n"
        "    r, s = streampool.get_current_device_resource(), streampool.Stream()\n"
        "    r.deallocate(r.allocate(size, s), size, s)\n"
        "    return size\n"
        "if __name__ == '__main__':\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        work(111)\n"
        "        os._exit(0)\n"
        "    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0\n"
        "    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "        assert pool.map(work, [222, 222]) == [222, 222]\n"
        "    work(333)\n"
        "    print('done')\n",
    )
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout
    assert sizes(log) == ["333", "333"]  # the parent's; the children are not profiled


def test_of_several_pythons_a_launcher_starts_the_first_is_profiled(tmp_path: Path) -> None:
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text(ALLOCATE.format(size=100))
    second.write_text(ALLOCATE.format(size=200))
    log = tmp_path / "app.log"
    python = sys.executable
    out = run("profile", "-o", str(log), "--", "sh", "-c", f"'{python}' {first} 3 && '{python}' {second} 5")
    assert out.returncode == 0, out.stderr
    assert sizes(log) == ["100"] * 6  # the second did not write over the first's log
    assert "is not profiled: another Python process of the program writes the log" in out.stderr
    assert "6 event(s) logged" in out.stderr


def test_a_python_that_ignores_pythonpath_is_said_to_log_nothing(tmp_path: Path) -> None:
    # -I ignores PYTHONPATH: the program finds streampool itself, wherever it is installed
    # (the GPU machine installs it with pip --target, on PYTHONPATH).
    where = str(Path(streampool.__file__).parent.parent)
    source = f"import sys; sys.path.insert(0, {where!r})\n" + ALLOCATE.format(size=100)
    out, log = profiled(tmp_path, source, "2", python=("-I",))
    assert out.returncode == 0, out.stderr
    assert "nothing was logged: no Python process of it started with profile's start-up hook" in out.stderr
    assert "event(s) logged" not in out.stderr and not log.exists()


def test_a_log_named_like_the_program_is_refused_and_nothing_is_removed(tmp_path: Path) -> None:
    program = tmp_path / "app.py"
    program.write_text(ALLOCATE.format(size=100))
    out = run("profile", "-o", "app.py", "--", sys.executable, "app.py", "1", cwd=tmp_path)
    assert out.returncode == 127
    assert "the log app.py is the program 'app.py': name another log with -o" in out.stderr
    assert program.read_text() == ALLOCATE.format(size=100)
    # A program that cannot start leaves the logs of an earlier run as they were.
    old, old_dev = tmp_path / "old.log", tmp_path / "old.log.dev3"
    old.write_text("earlier\n")
    old_dev.write_text("earlier\n")
    out = run("profile", "-o", str(old), "--", sys.executable, str(tmp_path / "typo.py"))
    assert out.returncode == 127 and "No such file or directory" in out.stderr
    assert old.read_text() == old_dev.read_text() == "earlier\n"


def test_recommend_reads_the_busiest_devices_log_and_names_the_others(tmp_path: Path) -> None:
    program, log = tmp_path / "prog.py", tmp_path / "app.log"
    program.write_text(
        "import streampool\n"
        "for device, n in ((0, 2), (1, 40)):\n"
        "    r = streampool.get_per_device_resource(device)\n"
        "    s = streampool.Stream(device=device)\n"
        "    for _ in range(n):\n"
        "        r.deallocate(r.allocate(1 << 16, s), 1 << 16, s)\n"
    )
    out = run(
        "recommend", "--quick", "-o", str(log), "--", sys.executable, str(program), STREAMPOOL_SIM_DEVICES="2"
    )
    assert out.returncode == 0, out.stderr
    assert "80 events replayed" in out.stdout
    assert (
        "recommending for device 1 (80 events), the busiest; not replayed: 4 on device 0 "
        f"({log})" in out.stderr
    )
    # The code it prints makes the choice device 1's resource, made on device 1; it runs.
    code = out.stdout.split("Apply it (before your program allocates):\n", 1)[1]
    code = "\n".join(line.removeprefix("    ") for line in code.splitlines() if line.startswith("    "))
    assert "set_per_device_resource(1, " in code and "device=1)" in code, code
    check = (
        code
        + "\nr = streampool.get_per_device_resource(1)\nprint(r.device, r is not streampool.get_per_device_resource(0))"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import streampool\n" + check],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_SIM_DEVICES="2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["1", "True"], (code, done.stderr)
    # Every allocation on device 1: its log, with no note (device 0's is empty).
    program.write_text(program.read_text().replace("(0, 2)", "(0, 0)"))
    out = run("recommend", "--quick", "--", sys.executable, str(program), STREAMPOOL_SIM_DEVICES="2")
    assert out.returncode == 0, out.stderr
    assert "80 events replayed" in out.stdout and "busiest" not in out.stderr


def test_a_closed_stdout_is_no_error(tmp_path: Path) -> None:
    program, log = tmp_path / "prog.py", tmp_path / "app.log"
    program.write_text(ALLOCATE.format(size=100) + "print('ran', file=sys.stderr)\n")
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    command = [
        sys.executable,
        "-m",
        "streampool",
        "profile",
        "-o",
        str(log),
        "--",
        sys.executable,
        str(program),
        "2",
    ]
    out = subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120
    )
    assert out.returncode == 0  # the control: then with stdout closed
    closed = subprocess.run(
        [*command[:3], "replay", str(log), "--quick", "--resources", "async"],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 0, closed.stderr
    assert "Traceback" not in closed.stderr
    closed = subprocess.run(
        command, env=env, stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1)
    )
    assert closed.returncode == 0 and "ran" in closed.stderr, closed.stderr
    assert sizes(log) == ["100"] * 4


@pytest.mark.parametrize(
    ("args", "status"), [((), 0), (("stress", "--seconds", "0.2", "--resources", "async"), 141)]
)
def test_a_reader_gone_stops_a_command_with_141_and_the_report_with_0(
    args: tuple[str, ...], status: int
) -> None:
    reader, writer = os.pipe()
    os.close(reader)  # gone before anything is written
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "streampool", *args],
            env=env,
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(writer)
    assert out.returncode == status, out.stderr
    assert "Traceback" not in out.stderr


def test_plot_into_a_directory_names_the_png_after_the_log(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, log = profiled(tmp_path, ALLOCATE.format(size=100), "3")
    assert out.returncode == 0, out.stderr
    plots = tmp_path / "plots"
    plots.mkdir()
    out = run("plot", str(log), "-o", str(plots))
    assert out.returncode == 0, out.stderr
    png = plots / "app.log.png"
    assert f"wrote {png}" in out.stdout and png.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "plots.png").exists()
    # A directory that does not exist: refused before the replay, no hidden ".png" made.
    missing = f"{tmp_path / 'new'}{os.sep}"
    out = run("plot", str(log), "-o", missing)
    assert (
        out.returncode == 3 and f"-o {missing}: the directory {tmp_path / 'new'} does not exist" in out.stderr
    )
    assert not (tmp_path / "new").exists()


PROFILED = """\
import ctypes, sys
import streampool
from streampool import _native, allocators

_native._set_profile_log(sys.argv[1])
# The C entry points (PyTorch's allocator) first: they take the logging adaptor too.
lib = ctypes.CDLL(allocators.library_path())
lib.streampool_alloc.restype = ctypes.c_void_p
lib.streampool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.streampool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
ptr = lib.streampool_alloc(4096, 0, None)
lib.streampool_free(ptr, 4096, 0, None)
streampool.DeviceBuffer(size=100)  # Python finds the same adaptor: one log, not truncated
_native._set_profile_log(None)
_native._reset_device_resources()
streampool.DeviceBuffer(size=200)  # not logged
print(type(streampool.get_current_device_resource()).__name__)
"""


def test_the_profile_log_serves_python_and_the_c_entry_points(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", PROFILED, str(log)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "CudaAsyncMemoryResource", out.stderr
    assert sizes(log) == ["4096", "4096", "100", "100"]


def test_the_profiled_resource_is_the_class_the_program_has_unprofiled(tmp_path: Path) -> None:
    # A program that reaches the default resource's pool (trim_to, as the README advises)
    # runs unchanged under profile: the class and its methods are the driver pool's, and
    # what it allocates through it is logged.
    out, log = profiled(
        tmp_path,
        "import streampool\n"
        "from streampool import mr\n"
        "r = streampool.get_current_device_resource()\n"
        "assert type(r) is mr.CudaAsyncMemoryResource and r is streampool.get_current_device_resource()\n"
        "s = streampool.Stream()\n"
        "r.deallocate(r.allocate(300, s), 300, s)\n"
        "assert r.pool_handle == mr.CudaAsyncMemoryResource().pool_handle and not r.owns_pool\n"
        "r.trim_to(0)\n"
        "print(repr(r).startswith('<LoggingAdaptor'))\n",
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr
    assert sizes(log) == ["300", "300"]


WORKER = r"""
#include <pthread.h>
#include <stddef.h>
typedef void *(*alloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);
static alloc_fn A;
static free_fn F;
static void *got;
static void *work(void *unused) {
    got = A(256, 0, NULL);
    if (got) F(got, 256, 0, NULL);
    return NULL;
}
/* Called with the GIL held (pybind11's default; ctypes.PyDLL): a worker thread allocates
   through the C entry point, and this waits for it, the GIL still held. */
int run_in_thread(alloc_fn a, free_fn f) {
    pthread_t t;
    A = a; F = f; got = NULL;
    pthread_create(&t, NULL, work, NULL);
    pthread_join(t, NULL);
    return got != NULL;
}
"""

GIL_HELD = """\
import ctypes, faulthandler, sys
from streampool import allocators
faulthandler.dump_traceback_later(30, exit=True)  # a hang ends the program, saying where
lib = ctypes.CDLL(allocators.library_path())
worker = ctypes.PyDLL(sys.argv[1])
ok = worker.run_in_thread(ctypes.cast(lib.streampool_alloc, ctypes.c_void_p),
                          ctypes.cast(lib.streampool_free, ctypes.c_void_p))
print("worker allocated:", bool(ok))
"""


def test_the_c_entry_points_take_no_gil_under_profile(tmp_path: Path) -> None:
    # A C++ extension that runs a worker thread with the GIL held, the worker allocating
    # through the C entry points: with the device's logging adaptor made through Python,
    # the worker waited for the GIL and the extension for the worker, for ever.
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    source, library = tmp_path / "worker.c", tmp_path / "libworker.so"
    source.write_text(WORKER)
    subprocess.run([compiler, "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)], check=True)
    out, log = profiled(tmp_path, GIL_HELD, str(library))
    assert out.returncode == 0 and "worker allocated: True" in out.stdout, out.stderr
    assert sizes(log) == ["256", "256"]


def test_threads_that_first_use_the_device_at_once_lose_no_event(tmp_path: Path) -> None:
    # Each makes the device's initial resource; one logging adaptor is kept (a second
    # opened the log again, truncating what the first had written).
    out, log = profiled(
        tmp_path,
        "import threading, streampool\n"
        "start = threading.Barrier(8)\n"
        "def work():\n"
        "    start.wait()\n"
        "    for _ in range(50):\n"
        "        streampool.DeviceBuffer(size=4096)\n"
        "threads = [threading.Thread(target=work) for _ in range(8)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n",
    )
    assert out.returncode == 0, out.stderr
    assert len(sizes(log)) == 800 and "800 event(s) logged" in out.stderr, out.stderr
    # The race itself, made certain: the device's initial resource asked for again (as the
    # losing thread asks) is the same adaptor, and the log keeps what it had.
    out, log = profiled(
        tmp_path,
        "import streampool\n"
        "from streampool import _native\n"
        "streampool.DeviceBuffer(size=100)\n"
        "_native._reset_device_resources()\n"
        "streampool.DeviceBuffer(size=200)\n",
    )
    assert out.returncode == 0, out.stderr
    assert sizes(log) == ["100", "100", "200", "200"]


def test_a_python_without_streampool_is_said_to_be_stopped_in_one_line(tmp_path: Path) -> None:
    from streampool.harness.profile import SHIM

    fake = tmp_path / "fake" / "streampool"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no streampool in this Python')\n")
    log = tmp_path / "app.log"
    path = os.pathsep.join([str(SHIM), str(fake.parent)])  # a Python whose streampool fails
    out = run(
        "profile", "-o", str(log), "--", "env", f"PYTHONPATH={path}", sys.executable, "-c", "print('ran')"
    )
    assert out.returncode == 127 and "ran" not in out.stdout
    said = [line for line in out.stderr.splitlines() if "simulated device" not in line]
    assert len(said) == 1 and "could not install the logging adaptor" in said[0], out.stderr
    assert not log.exists()


def test_a_program_that_enters_a_simulated_device_of_its_own_runs_profiled(tmp_path: Path) -> None:
    # The first backend to make a device's resource is the one logged: a simulated device
    # the program enters afterwards keeps its own resources, unlogged (its device 0 was
    # refused a second adaptor, naming neither backend).
    out, log = profiled(
        tmp_path,
        "import streampool\n"
        "from streampool.sim import SimulatedDevice\n"
        "streampool.DeviceBuffer(size=100)\n"
        "with SimulatedDevice(capacity_bytes='64MiB'):\n"
        "    streampool.DeviceBuffer(size=200)\n"
        "streampool.DeviceBuffer(size=300)\n"
        "print('done')\n",
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert sizes(log) == ["100", "100", "300", "300"]


FORK_WHILE_MAKING = """\\
import os, signal, sys, threading, time
import streampool
from streampool import _native

# The log a FIFO: making the device's logging adaptor blocks in opening it (as making a
# driver pool can take long on a GPU), the profile's lock held, until a reader comes.
_native._set_profile_log(sys.argv[1])
os.register_at_fork(after_in_child=lambda: _native._set_profile_log(None))  # as the shim
first_use = threading.Thread(target=streampool.get_current_device_resource, daemon=True)
first_use.start()
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    os._exit(0)
reader = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
first_use.join(30)
for _ in range(100):
    if os.waitpid(pid, os.WNOHANG)[0]:
        print("the child exited")
        break
    time.sleep(0.1)
else:
    os.kill(pid, signal.SIGKILL)
    print("the child hung in the at-fork handler")
"""


def test_a_fork_while_another_thread_makes_the_logged_resource_does_not_hang_the_child(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "log"
    os.mkfifo(fifo)
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_MAKING, str(fifo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "the child exited", (out.stdout, out.stderr)


def test_a_simulated_device_entered_first_leaves_the_programs_device_profiled(tmp_path: Path) -> None:
    out, log = profiled(
        tmp_path,
        "import streampool\n"
        "from streampool.sim import SimulatedDevice\n"
        "with SimulatedDevice(capacity_bytes='64MiB'):  # a dry run first\n"
        "    streampool.DeviceBuffer(size=64)\n"
        "streampool.DeviceBuffer(size=100)\n",
    )
    assert out.returncode == 0, out.stderr
    assert sizes(log) == ["100", "100"]
