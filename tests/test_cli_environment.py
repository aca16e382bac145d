"""The command line and the environment variables that choose the device: a bad value is
bad usage (one line, exit status 2) in every command, ``info`` included; the simulated
device's variables are read alike by ``info`` and the harness; a profiled program's own
child processes run the user's sitecustomize; every option's ``-h`` says what it does."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.nosim

GPU = os.environ.get("STREAMPOOL_GPU_TESTS") == "1"
VARIABLES = (
    "STREAMPOOL_DEVICE",
    "STREAMPOOL_SIM_CAPACITY",
    "STREAMPOOL_SIM_DEVICES",
    "STREAMPOOL_PROFILE_LOG",
)


#: This process's environment without the variables of the device and of profile.
ENV = {k: v for k, v in os.environ.items() if k not in VARIABLES}


def streampool(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``python -m streampool ARGS`` with exactly the device variables given."""
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args],
        env={**ENV, **environ},
        capture_output=True,
        text=True,
        timeout=120,
    )


def usage_error(out: subprocess.CompletedProcess[str], command: str, *words: str) -> None:
    """Exit status 2, nothing on stdout, one line on stderr: ``streampool COMMAND: ...``."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "", out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"streampool {command}: "), out.stderr
    for word in words:
        assert word in lines[0], out.stderr


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("log") / "app.log"
    path.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n1,100,allocate,0x1000,256,0x0\n1,200,free,0x1000,256,0x0\n"
    )
    return path


# A. A bad simulated-device variable: `info` (and `python -m streampool`) as `bench`.


@pytest.mark.parametrize(
    ("variable", "value"), [("STREAMPOOL_SIM_CAPACITY", "abc"), ("STREAMPOOL_SIM_DEVICES", "0")]
)
@pytest.mark.parametrize("args", [("info",), ()], ids=["info", "default"])
def test_info_refuses_a_bad_simulated_device_variable_in_one_line(
    variable: str, value: str, args: tuple[str, ...]
) -> None:
    out = streampool(*args, STREAMPOOL_DEVICE="sim", **{variable: value})
    usage_error(out, "info", f"the environment variable {variable} is '{value}'")
    # The same line as the harness's commands give.
    bench = streampool(
        "bench", "random", "--quick", "--resources", "async", STREAMPOOL_DEVICE="sim", **{variable: value}
    )
    usage_error(bench, "bench")
    assert bench.stderr.removeprefix("streampool bench: ") == out.stderr.removeprefix("streampool info: ")


# B. A STREAMPOOL_DEVICE that names no backend is bad usage, not an unusable driver.


@pytest.mark.parametrize(
    "args",
    [
        ("info",),
        (),
        ("bench", "random", "--quick", "--resources", "async"),
        ("stress", "--quick", "--seconds", "0.1"),
        ("replay", "LOG", "--quick"),
        ("recommend", "LOG", "--quick"),
        ("plot", "LOG"),
        ("profile", "-o", "OUT", "--", sys.executable, "-c", "print('the program ran')"),
        ("recommend", "--", sys.executable, "-c", "print('the program ran')"),
    ],
    ids=lambda a: a[0] if a else "default",
)
def test_a_device_that_names_no_backend_is_bad_usage(
    args: tuple[str, ...], log: Path, tmp_path: Path
) -> None:
    args = tuple(str(log) if a == "LOG" else str(tmp_path / "out.log") if a == "OUT" else a for a in args)
    out = streampool(*args, STREAMPOOL_DEVICE="gpu")
    usage_error(out, args[0] if args else "info", 'the environment variable STREAMPOOL_DEVICE is "gpu"')
    assert "unusable" not in out.stderr and "running on the simulated device" not in out.stderr
    assert "the program ran" not in out.stdout + out.stderr
    assert not (tmp_path / "out.log").exists()


# C. A profiled program's child processes (and theirs) run the user's own sitecustomize.

SPAWNS = """\
import os, subprocess, sys
import streampool
streampool.DeviceBuffer(size=64)
print("PYTHONPATH", os.environ.get("PYTHONPATH"), file=sys.stderr)
code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
subprocess.run([sys.executable, "-c", code], check=True)
"""


def _with_user_sitecustomize(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """\
            import os, sys
            with open(os.environ["SITE_MARKS"], "a") as f:
                f.write(f"{os.getpid()} {' '.join(sys.orig_argv[1:])[:40]}\\n")
            """
        )
    )
    (tmp_path / "prog.py").write_text(SPAWNS)
    pythonpath = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": pythonpath, "SITE_MARKS": str(tmp_path / "marks"), "STREAMPOOL_DEVICE": "sim"}


def _marks(tmp_path: Path) -> list[str]:
    lines = (tmp_path / "marks").read_text().splitlines()
    (tmp_path / "marks").unlink()
    return [line.split(" ", 1)[1] for line in lines]


def test_a_profiled_programs_children_run_the_users_sitecustomize(tmp_path: Path) -> None:
    env = _with_user_sitecustomize(tmp_path)
    plain = subprocess.run(
        [sys.executable, str(tmp_path / "prog.py")],
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == 0, plain.stderr
    unprofiled = _marks(tmp_path)
    assert len(unprofiled) == 3, unprofiled  # the program, its child, the child's child

    out = streampool(
        "profile", "-o", str(tmp_path / "p.log"), "--", sys.executable, str(tmp_path / "prog.py"), **env
    )
    assert out.returncode == 0, out.stderr
    profiled = _marks(tmp_path)
    assert profiled[1:] == unprofiled, profiled  # the first: `python -m streampool profile`
    # The program sees PYTHONPATH as it was (so do the programs it starts), not the shim's.
    assert f"PYTHONPATH {env['PYTHONPATH']}\n" in out.stderr, out.stderr
    assert "event(s) logged" in out.stderr, out.stderr


def test_the_shim_without_a_log_runs_the_users_sitecustomize(tmp_path: Path) -> None:
    from streampool.harness.profile import SHIM

    env = _with_user_sitecustomize(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), env["PYTHONPATH"]])
    code = "import os; print(os.environ['PYTHONPATH'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**ENV, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert len(_marks(tmp_path)) == 1
    assert out.stdout.strip() == env["PYTHONPATH"].split(os.pathsep, 1)[1]


# D. The simulated device's variables, read alike by `info` and the harness.


@pytest.mark.skipif(GPU, reason="this machine has a CUDA driver")
def test_info_without_a_driver_uses_the_simulated_device_variables() -> None:
    out = streampool("info", STREAMPOOL_SIM_CAPACITY="1GiB", STREAMPOOL_SIM_DEVICES="2")
    assert out.returncode == 0, out.stderr
    assert "(2 devices, 1 GiB each)" in out.stdout and "Devices:       2\n" in out.stdout, out.stdout
    assert "GPU 0:         streampool simulated device, 1.0 GiB (the current device)\n" in out.stdout
    assert "GPU 1:         streampool simulated device, 1.0 GiB\n" in out.stdout
    for variable, value in (("STREAMPOOL_SIM_CAPACITY", "abc"), ("STREAMPOOL_SIM_DEVICES", "1025")):
        usage_error(streampool("info", **{variable: value}), "info", f"{variable} is '{value}'")


@pytest.mark.parametrize("device", ["sim", ""], ids=["STREAMPOOL_DEVICE=sim", "no driver"])
def test_the_harness_uses_the_simulated_device_variables(device: str) -> None:
    if GPU and not device:
        pytest.skip("this machine has a CUDA driver")
    for value in ("0", "two", "1025"):
        out = streampool("bench", "random", "--quick", STREAMPOOL_DEVICE=device, STREAMPOOL_SIM_DEVICES=value)
        usage_error(
            out,
            "bench",
            f"STREAMPOOL_SIM_DEVICES is '{value}'; it must be a number of devices from 1 to 1024",
        )
    out = streampool(
        "stress",
        "--quick",
        "--seconds",
        "0.1",
        "--threads",
        "1",
        STREAMPOOL_DEVICE=device,
        STREAMPOOL_SIM_DEVICES=" 2 ",
        STREAMPOOL_SIM_CAPACITY="64MiB",
    )
    assert out.returncode == 0, out.stderr
    assert "simulated device" in out.stdout and "(2 devices, 64 MiB each)" in out.stdout, out.stdout


def test_the_variables_are_read_as_the_library_reads_them(tmp_path: Path) -> None:
    """Whatever the library's own simulated device (STREAMPOOL_DEVICE=sim) takes, the
    helper takes, as the same device; whatever it refuses, the helper refuses."""
    probe = textwrap.dedent(
        """\
        import sys
        import streampool
        from streampool._env import simulated_settings
        try:
            library = streampool.backend_description()
        except ValueError:
            library = None
        try:
            capacity, devices = simulated_settings()
        except ValueError:
            mine = None
        else:
            mine = streampool.sim.SimulatedDevice(capacity, devices).describe()
        if library is not None:  # the same numbers, whatever the device's own number
            library = library.split(" ", 3)[-1]
            mine = mine and mine.split(" ", 3)[-1]
        print(library == mine, library, mine)
        """
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    values = {
        "STREAMPOOL_SIM_CAPACITY": ["1GiB", " 64 MiB ", "1.5GiB", "0", "abc", "", "-1"],
        "STREAMPOOL_SIM_DEVICES": ["2", " 3 ", "+2", "1024", "0", "1025", "", "2.0", "1_0", "two"],
    }
    for variable, tries in values.items():
        for value in tries:
            # The capacity given: its default, what the host has free, may change between two reads.
            settings = {"STREAMPOOL_SIM_CAPACITY": "64MiB", variable: value}
            out = subprocess.run(
                [sys.executable, str(script)],
                env={**ENV, "STREAMPOOL_DEVICE": "sim", **settings},
                capture_output=True,
                text=True,
                timeout=60,
            )
            if not value.strip():  # blank is unset, as for STREAMPOOL_DEVICE: a device, no error
                # (a default capacity follows the host's free memory: two reads may differ)
                assert "None" not in out.stdout, (variable, out.stdout, out.stderr)
            else:
                assert out.stdout.startswith("True"), (variable, value, out.stdout, out.stderr)


# E. The -h screens, and a mistake shown with its command's usage.


def _commands() -> dict[str, argparse.ArgumentParser]:
    from streampool.harness import cli

    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_and_argument_says_what_it_is_and_its_default() -> None:
    missing = []
    for name, parser in _commands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
            elif action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in action.help:
                missing.append(f"{name} {'/'.join(action.option_strings)}: no default in {action.help!r}")
    assert not missing, missing


def test_the_help_screens_name_the_defaults() -> None:
    stress = streampool("stress", "-h").stdout
    for expected in ("(default 4)", "(default 0)", "print the JSON document"):
        assert expected in stress, stress
    recommend = streampool("recommend", "-h").stdout
    assert "print the JSON document" in recommend and "good lines of a malformed log" in recommend
    for command in ("replay", "plot"):
        assert "the log to " in streampool(command, "-h").stdout


@pytest.mark.parametrize(
    ("args", "command"),
    [(("info", "--json"), "info"), (("stress", "--bogus"), "stress"), (("bench", "random", "x"), "bench")],
)
def test_an_unknown_argument_is_refused_with_its_commands_usage(args: tuple[str, ...], command: str) -> None:
    out = streampool(*args, STREAMPOOL_DEVICE="sim")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"usage: streampool {command} "), out.stderr
    assert f"streampool {command}: error: unrecognized arguments: {args[-1]}" in out.stderr


# --- a driver that sees no device ---------------------------------------------------------------

CUDA_BACKEND = (
    Path(__file__).resolve().parents[1] / "rust" / "streampool" / "src" / "device" / "cuda" / "mod.rs"
)


def _no_device_driver(directory: Path) -> Path:
    """A stand-in ``libcuda.so.1`` in ``directory``: every symbol the library requires (read
    from its list), ``cuInit`` answering ``CUDA_ERROR_NO_DEVICE`` (100), as the driver does
    when ``CUDA_VISIBLE_DEVICES`` hides every GPU, and nothing else ever reached."""
    source = CUDA_BACKEND.read_text()
    listed = source.split("const REQUIRED_SYMBOLS: &[&str] = &[", 1)[1].split("];", 1)[0]
    symbols = [s.strip().strip('",') for s in listed.splitlines() if s.strip().startswith('"')]
    called = {"cuInit", "cuGetErrorName", "cuGetErrorString", "cuDriverGetVersion"}
    c = [
        "int cuInit(unsigned flags) { (void)flags; return 100; }",
        'int cuGetErrorName(int e, const char **s) { *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN"; return 0; }',
        'int cuGetErrorString(int e, const char **s) { (void)e; *s = "no CUDA-capable device is detected"; return 0; }',
        "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }",
    ]
    c += [f"int {name}(void) {{ return 999; }}" for name in symbols if name not in called]
    src = directory / "libcuda.c"
    src.write_text("\n".join(c) + "\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(src)], check=True)
    return directory


@pytest.mark.skipif(
    not __import__("shutil").which("cc"), reason="needs a C compiler to build a stand-in driver"
)
@pytest.mark.skipif(GPU, reason="a machine with a driver of its own")
@pytest.mark.parametrize("visible", [None, "", "-1"])
def test_a_driver_that_sees_no_device_names_cuda_visible_devices(tmp_path: Path, visible: str | None) -> None:
    env = {"LD_LIBRARY_PATH": str(_no_device_driver(tmp_path))}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    code = "import streampool\ntry:\n    streampool.DeviceBuffer(size=8)\nexcept streampool.CudaDriverNotFoundError as e:\n    print(e)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**{k: v for k, v in ENV.items() if k != "CUDA_VISIBLE_DEVICES"}, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "the CUDA driver sees no device" in out.stdout, out.stdout
    if visible is None:
        assert "CUDA_VISIBLE_DEVICES" not in out.stdout
    else:
        assert f"CUDA_VISIBLE_DEVICES is {visible!r}".replace("'", '"') in out.stdout, out.stdout
