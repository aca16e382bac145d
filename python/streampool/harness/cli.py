"""The ``streampool`` command line: ``info`` (the default), ``bench``, ``stress``,
``profile``, ``replay``, ``recommend``, ``plot``. See docs/harness.md for the reference.

Exit codes: 0 success; 1 a check failed (``stress`` found corruption, an overlap, a race
or an error); 2 bad usage (unknown command, workload, resource spec, option or parameter; a
``STREAMPOOL_DEVICE`` that names no backend, a ``STREAMPOOL_SIM_CAPACITY`` or
``STREAMPOOL_SIM_DEVICES`` the library refuses, in every command, ``info`` too); 3 bad input
(a malformed, empty or unreadable log, a log or plot directory that cannot be written); 4
cannot run here (a peer or an extra not installed, a workload larger than the
device, on a GPU managed memory asked to replay a log whose peak is above free memory (in
``bench`` and ``replay`` the other resources are measured and printed first), a resource that
failed, nothing measured: every allocation of every resource ran out of memory in ``bench``
or ``replay``, nothing to recommend: every candidate ran out of memory, or on a GPU the log's
peak is above free memory, which only managed memory fits, and nothing is replayed,
nothing verified: ``stress`` checked no allocation, every one refused, and found nothing wrong);
130 interrupted (143 ``bench`` or ``replay`` stopped by SIGTERM, as ``timeout`` sends; both
print the runs that had finished first). ``profile`` (and ``recommend -- CMD`` when the program fails) exits with the
program's own status, 127 when it could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from .. import __version__, _env
from .._errors import StreampoolError
from .._native import parse_size
from . import bench, plots, profile, recommend, stress, trace, workloads
from .device import SIMULATED_NOTE, Device, device
from .output import HARNESS_EXTRA, Output, document, human_bytes, human_ns, human_rate
from .specs import PeerMissingError, SpecError, make_resource, split_specs

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_BAD_INPUT, EXIT_CANNOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CANNOT_START = profile.CANNOT_START  # 127: the program to profile could not start
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: bench or replay stopped by SIGTERM
DEFAULT_RESOURCES = "async,pool(async),binning(async)"
JSON_HELP = "print the JSON document (schema streampool.harness/2)"
SKIP_MALFORMED_HELP = "use the good lines of a malformed log (and say how many were left out)"
NO_FRAMEWORKS_HELP = (
    "leave PyTorch, CuPy and Numba their own allocators (by default the program's PyTorch, CuPy "
    "and Numba allocate through the logged resource, so that their allocations are logged)"
)


class _Fail(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 1,4,16, not {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, not {text!r}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers (each is one run), not {text!r}")
    return values


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, not {text!r}")
    return value


def _finite(text: str, expected: str) -> float:
    """``text`` as a finite number, 0 or more; else the option's error, ``expected ...``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
    return value


def _scale(text: str) -> float:
    """``--gap-scale``: a finite number, 0 or more."""
    return _finite(text, "a finite number of 0 or more")


def _thread_count(text: str) -> int:
    value = _count(text)
    if value > workloads.MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {workloads.MAX_THREADS} threads, not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds (a finite one), not {text!r}"
        )
    return value


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, e.g. 1MiB, not {text!r}")
    return value


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    if value.lower() == "none":
        return key, None
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    return key, value


def _lead(text: str) -> float | None:
    """``--max-lead``: milliseconds (finite, 0 or more), or ``none``; in seconds."""
    if text.strip().lower() == "none":
        return None
    return _finite(text, "milliseconds (finite, 0 or more) or none") / 1000


MAX_LEAD_HELP = (
    "how far (ms of recorded time) a replay thread may run ahead of the others (default "
    f"{trace.MAX_LEAD * 1000:g}; none: no bound): the program's queues and locks are not in "
    "the log, and a producer left to run ahead of its consumer holds more memory than the program did"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streampool",
        description="Stream-ordered GPU memory: the environment report (the default command) and the harness "
        "that measures resources on your workload. Without a CUDA driver (or with STREAMPOOL_DEVICE=sim) "
        "everything runs on the simulated device, and says so.",
        epilog="Exit codes: 0 ok, 1 a check failed, 2 bad usage, 3 bad input, 4 cannot run here, "
        "127 the program to profile could not start, 130 interrupted, 141 the output's reader went away; "
        "profile exits with the program's status.",
    )
    p.add_argument("--version", action="version", version=f"streampool {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "info",
        help="the environment report (the default)",
        description="The environment report: the device, the driver, what the GPU supports, an "
        "allocate/free round trip through every resource, and the default resource.",
    )

    def measured(
        q: argparse.ArgumentParser,
        resources: str | None = DEFAULT_RESOURCES,
        default: str = "",
        quick: str = "small sizes and 2 repeats (a smoke test)",
    ) -> None:
        q.add_argument(
            "--resources",
            default=resources,
            help=f"comma-separated resource specs (default {default or resources}); see docs/harness.md",
        )
        q.add_argument("--repeats", type=_count, help="runs of each resource, interleaved (default 3)")
        q.add_argument("--json", action="store_true", help=JSON_HELP)
        q.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR (needs the harness extra)")
        q.add_argument("--quick", action="store_true", help=quick)

    b = sub.add_parser("bench", help="run a workload on resources side by side")
    b.add_argument("workload", help=f"one of: {', '.join(workloads.WORKLOADS)}")
    own = [f"{w.resources} for {w.name}" for w in workloads.WORKLOADS.values() if w.resources]
    measured(b, None, f"{DEFAULT_RESOURCES}; {'; '.join(own)}")
    b.add_argument("--threads", type=_int_list, help="thread counts, e.g. 1,4,16 (default 1)")
    b.add_argument("--streams", type=_count, help="streams (default: one per thread)")
    b.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload parameter, e.g. allocations=100000 (repeatable)",
    )
    b.add_argument("--log", help="the log, for the replay workload")
    b.add_argument(
        "--skip-malformed", action="store_true", help=f"for the replay workload: {SKIP_MALFORMED_HELP}"
    )

    s = sub.add_parser("stress", help="a randomised run with data verification")
    s.add_argument("--resources", default="pool(async)", help="resource specs (default pool(async))")
    s.add_argument("--seconds", type=_seconds, help="how long, per resource (default 10; 2 with --quick)")
    s.add_argument(
        "--threads",
        type=_thread_count,
        default=4,
        help="threads, each with --streams streams (default %(default)s)",
    )
    s.add_argument("--streams", type=_count, default=2, help="streams per thread (default 2)")
    s.add_argument("--max-size", type=_size, default="1MiB", help="the largest allocation (default 1MiB)")
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of each thread's random operations and sizes (default %(default)s)",
    )
    s.add_argument("--quick", action="store_true", help="2 seconds (unless --seconds is given)")
    s.add_argument("--json", action="store_true", help=JSON_HELP)

    pr = sub.add_parser(
        "profile",
        help="run a program with every allocation logged",
        usage="streampool profile [-h] [-o LOG] [--no-frameworks] -- python prog.py ARGS",
    )
    pr.add_argument("-o", "--output", default="streampool-profile.log", help="the log (default %(default)s)")
    pr.add_argument("--no-frameworks", action="store_true", help=NO_FRAMEWORKS_HELP)

    r = sub.add_parser("replay", help="replay a log (streampool's or RMM's CSV) on resources")
    r.add_argument("log", help="the log to replay: streampool's (profile -o LOG) or RMM's CSV")
    measured(r, quick="2 repeats (the log is replayed whole)")
    r.add_argument(
        "--gap-scale",
        type=_scale,
        default=0.0,
        help="recorded gaps times this (default 0: as fast as possible; 1: as recorded)",
    )
    r.add_argument("--max-lead", type=_lead, default=trace.MAX_LEAD, metavar="MS", help=MAX_LEAD_HELP)
    r.add_argument(
        "--passes",
        type=_count,
        default=1,
        help="replay the whole log this many times over in each run (default 1): for a log too "
        "short to time alone (recommend chooses this itself)",
    )
    r.add_argument("--skip-malformed", action="store_true", help=SKIP_MALFORMED_HELP)

    rc = sub.add_parser("recommend", help="which resource suits a log (or a program, profiled first)")
    rc.add_argument("log", nargs="?", help="the log; or, instead, `-- python prog.py ARGS` to profile first")
    rc.add_argument("--repeats", type=_count, help="runs of each candidate (default 3)")
    rc.add_argument("--json", action="store_true", help=JSON_HELP)
    rc.add_argument("--quick", action="store_true", help="2 repeats")
    rc.add_argument("--skip-malformed", action="store_true", help=SKIP_MALFORMED_HELP)
    rc.add_argument("--max-lead", type=_lead, default=trace.MAX_LEAD, metavar="MS", help=MAX_LEAD_HELP)
    rc.add_argument(
        "-o", "--output", help="with `-- prog`: where to keep the log (default: a temporary file)"
    )
    rc.add_argument("--no-frameworks", action="store_true", help="with `-- prog`: " + NO_FRAMEWORKS_HELP)

    pl = sub.add_parser("plot", help="PNG of live and reserved bytes over time, and latencies, from a log")
    pl.add_argument("log", help="the log to plot: streampool's (profile -o LOG) or RMM's CSV")
    pl.add_argument("-o", "--output", help="the PNG (default LOG.png; in a directory, LOG's name with .png)")
    pl.add_argument(
        "--resource", default="async", help="replay on this spec for reserved bytes (default async)"
    )
    pl.add_argument("--skip-malformed", action="store_true", help=SKIP_MALFORMED_HELP)
    for command_parser in sub.choices.values():  # a mistake is shown with its command's usage
        command_parser.set_defaults(command_parser=command_parser)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    program: list[str] = []
    if "--" in argv:  # everything after the first `--` is the program to profile
        cut = argv.index("--")
        argv, program = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the command's parser, whose usage fits: `streampool info --json`
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    args.program = program
    command = args.command or "info"
    if program and command not in ("profile", "recommend"):
        print(f"streampool {command}: takes no program after `--`", file=sys.stderr)
        return EXIT_USAGE
    try:
        if command == "info":
            from ..__main__ import report

            report()
            return EXIT_OK
        with device() as dev:
            return int(globals()[f"_cmd_{command}"](args, dev))
    except _Fail as e:
        print(f"streampool {command}: {e}", file=sys.stderr)
        return e.code
    except (SpecError, ValueError) as e:
        code = EXIT_BAD_INPUT if isinstance(e, trace.LogFormatError) else EXIT_USAGE
        print(f"streampool {command}: {e}", file=sys.stderr)
        return code
    except BrokenPipeError:
        raise  # `streampool ... | head`: handled (quietly, status 0) by __main__
    except OSError as e:
        # "app.log: No such file or directory", not Python's "[Errno 2] ...: 'app.log'".
        said = f"{e.filename}: {e.strerror}" if e.filename is not None and e.strerror else str(e)
        print(f"streampool {command}: {said}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TypeError as e:  # a --param the workload cannot use
        print(f"streampool {command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (
        PeerMissingError,
        workloads.WorkloadError,
        plots.PlotsUnavailableError,
        recommend.NothingToRecommendError,
        StreampoolError,
        MemoryError,
    ) as e:
        print(f"streampool {command}: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:
        print(f"streampool {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _specs(text: str) -> list[str]:
    specs = split_specs(text)
    for s in specs:  # every spec is checked (and peers found) before anything runs
        try:
            make_resource(s)
        except (StreampoolError, MemoryError) as e:  # made, and refused by the device: name which
            raise _Fail(EXIT_CANNOT_RUN, f"resource {s}: {e}") from None
    return specs


def _announce(out: Output, dev: Device) -> None:
    if dev.simulated:
        out.line(f"Device: {dev.description} ({dev.reason}). {SIMULATED_NOTE}.")
    else:
        out.line(f"Device: {dev.headline()}")


def _range(s: dict[str, float], fmt: Any = human_rate) -> str:
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def _latencies(p: dict[str, int]) -> str:
    """p50 / p99, or "-" where no call succeeded (the percentiles of no samples are zeros)."""
    return "-" if p["max"] == 0 else f"{human_ns(p['p50'])} / {human_ns(p['p99'])}"


def _results_table(out: Output, title: str, summary: list[dict[str, Any]]) -> None:
    """The results table. The peak live bytes are the run's own (a replay's threads do not
    wait for each other as the program's did, so they may run ahead and hold more than the
    program had live; ``--gap-scale 1`` keeps the pace). The throughput counts the work that
    succeeded; the allocations that ran out of memory are beside it."""
    rows = []
    for r in summary:
        ratio = r["ratio_to_first"]
        rows.append(
            [
                r["resource"],
                str(r["threads"]),
                _range(r["throughput"]),
                str(r["oom_events"]),
                _range(ratio, lambda x: f"{x:.2f}") if ratio else "-",
                f"{100 * r['alloc_share']['median']:.1f}%",
                _latencies(r["allocate"]),
                human_ns(r["longest_call_ns"]) if r["longest_call_ns"] else "-",
                f"{human_bytes(r['peak_live_bytes'])} / {human_bytes(r['peak_reserved_bytes'])}",
                "-" if r["synchronizations"] is None else f"{r['synchronizations']}/{r['waits'] or 0}",
            ]
        )
    columns = [
        "resource",
        "threads",
        f"{summary[0]['unit'] if summary else ''} median [min-max]",
        "OOM",
        "ratio to first",
        "alloc share",
        "alloc p50 / p99",
        "longest call",
        "peak live / reserved",
        "syncs/waits",
    ]
    # The resource's own driver calls per chunk: the native pipeline reports them.
    if any(r.get("driver_calls_per_chunk") for r in summary):
        columns.append("driver calls/chunk")
        for row, r in zip(rows, summary):
            calls = r.get("driver_calls_per_chunk")
            row.append(_range(calls, lambda x: f"{x:.2f}") if calls else "-")
    # The calls over long_call_us, by what their thread did (the native pipeline), and the
    # null calls over it (with null_call_us).
    if any(r.get("long_calls") for r in summary):
        over = next(r["long_calls"]["over_ns"] for r in summary if r.get("long_calls"))
        for key, what in (("long_calls", "calls"), ("null_calls", "null calls")):
            if key == "null_calls" and not any(r.get(key) for r in summary):
                continue
            columns.append(f"{what} > {human_ns(over)}: preempted/slept/stolen/on CPU")
            for row, r in zip(rows, summary):
                lc = r.get(key)
                row.append(
                    f"{lc['calls']}: {lc['preempted']}/{lc['slept']}/{lc['stolen']}/{lc['on_cpu']}"
                    if lc
                    else "-"
                )
        # And where the watchdog found their threads (the classes it saw, most first), and
        # where the running ones ran.
        for column, part in (("seen in", "sampled"), ("running in", "running_in")):
            columns.append(column)
            for row, r in zip(rows, summary):
                seen = sorted((r.get("long_calls") or {}).get(part, {}).items(), key=lambda kv: -kv[1])
                row.append(", ".join(f"{k} {n}" for k, n in seen if n) or "-")
    out.table(title, columns, rows)


def _strip(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]


def _read_log(out: Output, log: str, skip_malformed: bool = False, name: str | None = None) -> trace.Trace:
    """The trace of ``log``, refused (exit 3) when it has no allocation to replay; with
    ``skip_malformed``, the report says how many lines were left out. ``name``: what the
    messages call the log (a temporary one's path would name a file already gone)."""
    t = trace.read_log(log, skip_malformed=skip_malformed)
    name = name or log
    if t.malformed:
        out.line(f"{name}: {t.malformed} malformed line(s) skipped (--skip-malformed)")
    if t.events:
        if t.recorded_failures or t.unmatched_frees:
            out.line(
                f"{name}: not replayed: {t.recorded_failures} allocation(s) that failed when recorded and "
                f"{t.unmatched_frees} free(s) of memory the log did not see allocated (allocated before it "
                "began, or freed twice)"
            )
        return t
    if not (t.recorded_failures or t.unmatched_frees):
        raise _Fail(
            EXIT_BAD_INPUT,
            f"{name}: no events: no allocations to replay (none of 1 byte or more: a 0-byte "
            "allocation is the null pointer, not replayed)",
        )
    raise _Fail(
        EXIT_BAD_INPUT,
        f"{name}: no allocations to replay (only {t.recorded_failures} failed allocation(s) and "
        f"{t.unmatched_frees} free(s) of memory allocated before the log began)",
    )


def _check_replayable(t: trace.Trace, name: str) -> trace.Trace:
    """``t``, refused (exit 3) when it has more threads than the replayer runs."""
    try:
        workloads.check_replay_threads(t, name)
    except ValueError as e:
        raise _Fail(EXIT_BAD_INPUT, str(e)) from None
    return t


def _check_plot_dir(args: argparse.Namespace) -> None:
    """Before any work: a clear message when matplotlib is missing or ``--plot DIR`` cannot
    be written."""
    if not args.plot:
        return
    plots._plt()
    try:
        plots.writable_dir(args.plot)
    except OSError as e:
        raise _Fail(
            EXIT_BAD_INPUT, f"--plot {args.plot}: cannot write plots there: {e.strerror or e}"
        ) from None


class _Terminated:
    """SIGTERM's arrival while :func:`_sigterm_interrupts` is in force (``signalled``).
    While ``raising``, its handler raises KeyboardInterrupt, which stops a measurement;
    after, it only records, so that a report being written is finished."""

    def __init__(self) -> None:
        self.signalled, self.raising = False, True


@contextlib.contextmanager
def _sigterm_interrupts() -> Any:
    """SIGTERM (what ``timeout`` and job schedulers send) stops the block's measurement as
    Ctrl-C does, so that the worker threads are stopped and the runs that finished are
    reported; the previous handler is put back after. In the main thread only (signals go
    there), and not where SIGTERM is ignored (as the program was started)."""
    seen = _Terminated()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    ):
        yield seen
        return

    def terminated(signum: int, frame: Any) -> None:
        seen.signalled = True
        if seen.raising:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield seen
    finally:
        profile.put_back(signal.SIGTERM, previous)


def _measure_and_report(
    args: argparse.Namespace,
    out: Output,
    dev: Device,
    workload: str,
    specs: list[str],
    threads: list[int],
    streams: int,
    params: dict[str, Any],
    title: str,
    extra: dict[str, Any],
) -> int:
    # Refused before anything runs, so that a refusal loses none of the others' results.
    refused = bench.refused(workload, specs, threads, params)
    if len(refused) == len(specs):
        raise workloads.WorkloadError("; ".join(refused.values()))
    specs = [s for s in specs if s not in refused]
    # SIGTERM stops the measurement as Ctrl-C does, and waits for the report.
    with _sigterm_interrupts() as term:
        repeats = args.repeats or (2 if args.quick else 3)

        def progress(items: Any, total: int, label: str) -> Any:
            shown = out.progress(items, total, label)
            try:
                for item in shown:
                    if term.signalled:  # its KeyboardInterrupt was lost (raised in a finaliser)
                        raise KeyboardInterrupt
                    yield item
            finally:
                getattr(shown, "close", lambda: None)()

        stopped: bench.Interrupted | None = None
        try:
            runs, summary = bench.measure(workload, specs, threads, streams, repeats, params, progress)
        except bench.Interrupted as e:
            stopped, runs, summary = e, e.runs, e.summary
        finally:
            term.raising = False
        status = EXIT_TERMINATED if term.signalled else EXIT_INTERRUPTED
        if stopped is not None and not runs:
            raise _Fail(status, "interrupted")
        done = f"; INTERRUPTED after {len(runs)} of {stopped.planned} runs" if stopped else ""
        _results_table(
            out,
            f"{title} ({repeats} run{'s' if repeats != 1 else ''} each, interleaved; ratio to {specs[0]} in the same run{done})"
            + (" [simulated device]" if dev.simulated else ""),
            summary,
        )
        files = plots.bench_plots(workload, summary, runs, args.plot, dev.simulated) if args.plot else []
        for f in files:
            out.line(f"wrote {f}")
        if args.json:
            shown = {
                k: (getattr(args, "log", None) if isinstance(v, trace.Trace) else v)
                for k, v in params.items()
            }
            out.emit_json(
                document(
                    args.command,
                    dev,
                    workload=workload,
                    params=shown,
                    repeats=repeats,
                    runs=_strip(runs),
                    summary=summary,
                    plots=files,
                    interrupted=stopped is not None,
                    planned={"resources": specs, "threads": threads},
                    **extra,
                )
            )
        for why in refused.values():
            print(f"streampool {args.command}: not measured: {why}", file=sys.stderr)
        _too_short(args, workload, runs, params)
        bad = [r for r in summary if r["mismatches"]]
        for r in bad:
            print(
                f"streampool {args.command}: DATA CORRUPTION: {r['mismatches']} chunk(s) with wrong data on "
                f"{r['resource']} at {r['threads']} thread(s)",
                file=sys.stderr,
            )
        if bad:
            return EXIT_CHECK_FAILED
        if stopped is not None:
            print(
                f"streampool {args.command}: interrupted after {len(runs)} of {stopped.planned} runs: "
                "the results above are of the runs that finished",
                file=sys.stderr,
            )
            return status
        if term.signalled:  # after the last run: every run finished, and the report is whole
            print(f"streampool {args.command}: terminated after its last run", file=sys.stderr)
            return EXIT_TERMINATED
        if runs and all(r["oom_events"] and not r["events"] for r in runs):
            failed = sum(r["oom_events"] for r in runs)
            print(
                f"streampool {args.command}: nothing measured: every allocation ran out of memory on every "
                f"resource ({failed} failed allocation(s) in {len(runs)} run(s)); smaller sizes or a "
                "larger device may let it run",
                file=sys.stderr,
            )
            return EXIT_CANNOT_RUN
        return EXIT_CANNOT_RUN if refused else EXIT_OK


def _cmd_bench(args: argparse.Namespace, dev: Device) -> int:
    if args.workload not in workloads.WORKLOADS:
        raise _Fail(
            EXIT_USAGE,
            f"unknown workload {args.workload!r}; valid workloads: {', '.join(workloads.WORKLOADS)}",
        )
    w = workloads.WORKLOADS[args.workload]
    given = dict(args.param)
    for own, how in (("threads", "--threads (a list: each value is measured)"), ("streams", "--streams N")):
        if own in w.ignores and (own in given or getattr(args, own) is not None):
            option = f"--param {own}=..." if own in given else f"--{own}"
            raise _Fail(EXIT_USAGE, f"{option} does not apply to the {w.name} workload: {w.ignores[own]}")
        if own in given:
            raise _Fail(EXIT_USAGE, f"--param {own}=...: give it as {how}")
    if "log" in given and w.name == "replay":
        raise _Fail(EXIT_USAGE, "--param log=...: give the replay workload's log as --log LOG")
    # What --param takes: the workload's own parameters, less those given as options.
    takes = [p for p in w.parameters if p not in ("threads", "streams", "log")]
    unknown = [p for p in given if p not in takes]
    if unknown:
        raise _Fail(
            EXIT_USAGE,
            f"workload {w.name!r} takes no parameter {', '.join(map(repr, unknown))}; its --param "
            f"parameters: {', '.join(takes) or 'none'}",
        )
    if (args.log is not None) != (w.name == "replay"):
        raise _Fail(
            EXIT_USAGE,
            "the replay workload needs --log LOG"
            if w.name == "replay"
            else f"--log is for the replay workload; the {w.name} workload reads no log",
        )
    if args.skip_malformed and w.name != "replay":
        raise _Fail(
            EXIT_USAGE, f"--skip-malformed is for the replay workload; the {w.name} workload reads no log"
        )
    params = dict(w.quick) if args.quick else {}
    params.update(given)
    workloads.check(w.name, params)
    for n in args.threads or []:
        workloads.check_param(w.name, "threads", n, "int")
    workloads.check_events(w.name, params, max(args.threads or [1]))
    default = w.resources or DEFAULT_RESOURCES
    specs = _specs(default if args.resources is None else args.resources)
    _check_plot_dir(args)
    out = Output(args.json)
    threads, streams = args.threads or [1], args.streams or 0
    if w.name in ("random", "window") and streams > max(threads):
        # Thread t works on stream t % streams: streams beyond the threads stay unused.
        out.line(
            f"note: {w.name} puts one thread on a stream; --streams {streams} runs {max(threads)} at most"
        )
    if w.name == "replay":  # the log's own threads and streams
        t = _check_replayable(_read_log(out, args.log, args.skip_malformed), args.log)
        params["log"] = t
        threads, streams = [t.threads], t.streams
    _announce(out, dev)
    return _measure_and_report(args, out, dev, w.name, specs, threads, streams, params, f"bench {w.name}", {})


def _cmd_replay(args: argparse.Namespace, dev: Device) -> int:
    params: dict[str, Any] = {"gap_scale": args.gap_scale, "max_lead": args.max_lead, "passes": args.passes}
    workloads.check("replay", params)
    specs = _specs(args.resources)
    _check_plot_dir(args)
    out = Output(args.json)
    t = _check_replayable(_read_log(out, args.log, args.skip_malformed), args.log)
    if args.passes * t.events > workloads.MAX_REPLAY_EVENTS:
        raise _Fail(
            EXIT_USAGE,
            f"--passes {args.passes} times the log's {t.events} events is more than "
            f"{workloads.MAX_REPLAY_EVENTS:,} events a run",
        )
    _announce(out, dev)
    log_info = {
        "path": args.log,
        "events": t.events,
        "threads": t.threads,
        "streams": t.streams,
        "recorded_failures": t.recorded_failures,
        "unmatched_frees": t.unmatched_frees,
        "closing_frees": t.closing_frees,
        "malformed_lines": t.malformed,
    }
    return _measure_and_report(
        args,
        out,
        dev,
        "replay",
        specs,
        [t.threads],
        t.streams,
        {"log": t, **params},
        f"replay {os.path.basename(args.log)}: {t.events} events"
        + (f", {args.passes} times over in each run" if args.passes > 1 else ""),
        {"log": log_info},
    )


def _too_short(
    args: argparse.Namespace, workload: str, runs: list[dict[str, Any]], params: dict[str, Any] | None = None
) -> None:
    """A line on stderr when a trace replay's shortest run (``replay``, ``random``,
    ``window``) was too short to time (the figures then change from one invocation to the
    next), with what would at least make it long enough: more passes of a log, more
    allocations of a generated trace (a short run's time is mostly its threads' start:
    more may be needed). Not for ``--quick``, a smoke test."""
    # Runs that ran out of memory did less than their work: no measure of its length.
    timed = [r for r in runs if r["events"] and not r["oom_events"]]
    if workload not in ("replay", "random", "window") or not timed or getattr(args, "quick", False):
        return
    shortest = min(timed, key=lambda r: r["seconds"])
    if shortest["seconds"] >= recommend.MIN_RUN_SECONDS:
        return
    scale = recommend.passes_for(shortest["events"], shortest["seconds"])
    given = params or {}
    if workload == "replay":
        enough = (shortest.get("passes") or given.get("passes", 1)) * scale
        option = {"replay": f"--passes {enough}", "bench": f"--param passes={enough}"}.get(args.command)
    else:
        declared = workloads.WORKLOADS[workload].declared()["allocations"].default
        enough = int(given.get("allocations", declared)) * scale
        option = f"--param allocations={enough}"
    how = f"; try {option} or more" if option and scale > 1 else ""
    print(
        f"streampool {args.command}: runs as short as {shortest['seconds'] * 1e3:.2f} ms "
        f"({shortest['resource']}, {shortest['threads']} thread(s)) are too short to time: the figures "
        f"may change from one invocation to the next{how}",
        file=sys.stderr,
    )


def _profile_into(
    program: list[str],
    log: str,
    dev: Device,
    output_to_stderr: bool = False,
    temporary: bool = False,
    frameworks: bool = True,
) -> tuple[int, list[str]]:
    """Profiles ``program`` into ``log``; its status, and the libraries among PyTorch, CuPy
    and Numba that allocated through the logged resource. ``output_to_stderr``: the
    program's stdout goes to stderr (a JSON document alone goes to stdout); ``temporary``:
    the log is removed after use (the messages say so); ``frameworks``: route those
    libraries (:func:`streampool.harness.profile.run`)."""
    if not program:
        raise _Fail(EXIT_USAGE, "nothing to run: give the program after --, e.g. -- python prog.py ARGS")
    try:
        profile.check_program(program, log)  # before the old log is removed
    except profile.CannotStartError as e:
        raise _Fail(EXIT_CANNOT_START, str(e)) from None
    profile.check_log(log)  # before the program runs: an OSError naming the log, exit 3
    if dev.simulated:
        print(
            f"streampool profile: {dev.reason}: the program runs on the simulated device "
            "(STREAMPOOL_DEVICE=sim)",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="streampool-") as scratch:
        notes_file = os.path.join(scratch, "frameworks")
        try:
            status = profile.run(program, log, dev.simulated, output_to_stderr, frameworks, notes_file)
        except profile.CannotStartError as e:
            raise _Fail(EXIT_CANNOT_START, str(e)) from None
        notes = profile.read_notes(notes_file)
    routed = profile.routed(notes)
    if routed:
        print(
            f"streampool profile: {_and(routed)} allocated through the logged resource, so that "
            "what they allocated is logged (--no-frameworks leaves them their own allocators)",
            file=sys.stderr,
        )
    for library, done in notes.items():
        if library not in routed:
            what = "not all" if done.startswith("replaced") else "nothing"
            print(
                f"streampool profile: {what} of what {library} allocated is logged: {done}", file=sys.stderr
            )
    if not os.path.exists(log):
        if status == EXIT_CANNOT_START:  # the shim stopped it, and said why in one line
            return status, routed
        # The shim claims the log as the first Python of the program starts: none did.
        print(
            f"streampool profile: the program exited with status {status} and nothing was logged: "
            "no Python process of it started with profile's start-up hook (a Python run with -E "
            "or -I ignores PYTHONPATH, which carries the hook; a program that is not Python and "
            "starts no Python is not profiled)",
            file=sys.stderr,
        )
        return status, routed
    # One log per device (device N > 0 to LOG.devN): each is named, with its events.
    logs = [(device, path, profile.logged_events(path)) for device, path in profile.device_logs(log)]
    events = sum(n for _, _, n in logs)
    if len(logs) == 1:
        where = "a temporary log (-o LOG keeps it)" if temporary else log
    elif temporary:
        where = "one temporary log per device (-o LOG keeps them): " + ", ".join(
            f"{n} on device {device}" for device, _, n in logs
        )
    else:
        where = "one log per device: " + ", ".join(
            f"{n} to {path} (device {device})" for device, path, n in logs
        )
    if status != 0 and temporary:  # recommend stops here, and the log goes
        print(
            f"streampool profile: the program exited with status {status}, after {events} event(s); "
            "nothing is replayed, and the temporary log is removed (-o LOG keeps it)",
            file=sys.stderr,
        )
    elif status != 0:
        kept = "the log keeps" if len(logs) == 1 else "the logs keep"
        print(
            f"streampool profile: the program exited with status {status}; {kept} the "
            f"{events} event(s) recorded until then{': ' if len(logs) == 1 else ', '}{where}",
            file=sys.stderr,
        )
    else:
        logged = " to " if len(logs) == 1 else ", "
        print(f"streampool profile: {events} event(s) logged{logged}{where}", file=sys.stderr)
    if events == 0 and status == 0:  # a program that failed may have failed before allocating
        print(
            "streampool profile: nothing allocated through the devices' resources, which profile "
            "logs: the program allocates through a resource it sets itself "
            "(set_current_device_resource, as recommend's code does) or passes explicitly (mr= to "
            "DeviceBuffer), through another library's "
            "own allocator (RMM's, as cuDF does; PyTorch's, CuPy's or Numba's under --no-frameworks), "
            "on a simulated device it makes itself (`with SimulatedDevice():`; set "
            "STREAMPOOL_DEVICE=sim instead), or not at all. Profile it without its own set-up lines (or mr= arguments); "
            "to see what a resource of its own does, wrap it in mr.StatisticsResourceAdaptor",
            file=sys.stderr,
        )
    return status, routed


def _and(names: list[str]) -> str:
    """``A``, ``A and B``, ``A, B and C``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _cmd_profile(args: argparse.Namespace, dev: Device) -> int:
    return _profile_into(args.program, args.output, dev, frameworks=not args.no_frameworks)[0]


def _busiest_log(log: str, keep: bool) -> str:
    """Of a profile's logs (one per device), the one with the most events, which recommend
    reads; a note on stderr names the others that have events (``keep``: they stay, for
    ``recommend LOG.devN``)."""
    logs = [(profile.logged_events(path), device, path) for device, path in profile.device_logs(log)]
    events, device, chosen = max(logs, key=lambda x: (x[0], -x[1]))
    others = [(n, d, p) for n, d, p in logs if n and p != chosen]
    if others:
        rest = ", ".join(f"{n} on device {d}" + (f" ({p})" if keep else "") for n, d, p in others)
        how = "`streampool recommend` on each kept log" if keep else "-o LOG keeps every device's log"
        print(
            f"streampool recommend: the program allocated on several devices; recommending for "
            f"device {device} ({events} events), the busiest; not replayed: {rest} ({how})",
            file=sys.stderr,
        )
    return chosen


def _cmd_recommend(args: argparse.Namespace, dev: Device) -> int:
    if args.program and args.log is not None:
        raise _Fail(EXIT_USAGE, "give a log or `-- python prog.py ARGS`, not both")
    if not args.program and args.log is None:
        raise _Fail(EXIT_USAGE, "give a log, or `-- python prog.py ARGS` to profile a program first")
    if args.output is not None and not args.program:
        raise _Fail(
            EXIT_USAGE, "-o names where a profiled program's log goes: it is for `-- python prog.py ARGS`"
        )
    if args.no_frameworks and not args.program:
        raise _Fail(
            EXIT_USAGE,
            "--no-frameworks is for a program profiled first (`-- python prog.py ARGS`): a log was "
            "profiled already",
        )
    out = Output(args.json)
    routed: list[str] | None = None  # the libraries routed in the profile (None: a log given)
    with contextlib.ExitStack() as cleanup:
        log = args.log
        if args.program:
            # Without -o, the profile goes to a temporary directory, removed once read.
            log = args.output or os.path.join(
                cleanup.enter_context(tempfile.TemporaryDirectory(prefix="streampool-")), "profile.log"
            )
            status, routed = _profile_into(
                args.program,
                log,
                dev,
                args.json,
                temporary=not args.output,
                frameworks=not args.no_frameworks,
            )
            if status != 0:
                return status
            log = _busiest_log(log, keep=bool(args.output))
        temporary = bool(args.program) and not args.output
        name = "the program's profile" if temporary else None
        t = _check_replayable(_read_log(out, log, args.skip_malformed, name=name), name or log)
    repeats = args.repeats or (2 if args.quick else 3)
    _announce(out, dev)
    prof = recommend.analyse(t)
    unmeasurable = recommend.unmeasurable(prof)
    if unmeasurable is not None:
        if args.json:
            out.emit_json(
                _recommend_document(dev, log, args.max_lead, repeats, [], [], prof, None, unmeasurable)
            )
        raise _Fail(EXIT_CANNOT_RUN, unmeasurable)
    params: dict[str, Any] = {"log": t, "gap_scale": 0.0, "max_lead": args.max_lead}
    passes, once = recommend.calibrate(t, prof.candidates, params)
    runs, summary = bench.measure(
        "replay",
        prof.candidates,
        [t.threads],
        t.streams,
        repeats,
        params,
        out.progress,
        by_spec={spec: {"passes": n} for spec, n in passes.items()},
    )
    least, most = min(passes.values()), max(passes.values())
    replayed = (
        f"the log's {t.events} events replayed {least if least == most else f'{least} to {most}'} "
        f"times over in each run{'' if least == most else ', as each candidate needs'} (one replay "
        f"took {once * 1e3:.2f} ms on the fastest, too short to time alone)"
        if most > 1
        else f"{t.events} events replayed"
    )
    _results_table(
        out,
        f"recommend: {replayed}, {repeats} runs of each candidate"
        + (" [simulated device]" if dev.simulated else ""),
        summary,
    )
    _too_short(args, "replay", runs)
    try:
        choice = recommend.choose(prof, summary, device=profile.log_device(log), frameworks=routed)
    except recommend.NothingToRecommendError as e:
        # The measurements stand: --json still prints them, with no recommendation.
        if args.json:
            out.emit_json(
                _recommend_document(
                    dev, log, args.max_lead, repeats, runs, summary, prof, None, str(e), passes
                )
            )
        raise
    out.line(f"Recommended: {choice['headline']}")
    if dev.simulated:
        out.line(f"  ({SIMULATED_NOTE})")
    out.line("Why:")
    for reason in choice["reasons"]:
        out.line(f"  - {reason}")
    out.line("Apply it (before your program allocates):")
    for code_line in choice["code"].splitlines():
        out.line(f"    {code_line}")
    if routed is None and ":" not in choice["choice"]:
        out.line(
            "  (a program whose PyTorch, CuPy or Numba allocated through the logged resource, as "
            "`streampool profile` has them do unless --no-frameworks: add "
            "`from streampool import allocators; allocators.use_on_import()` after these lines)"
        )
    if dev.simulated and not os.environ.get("STREAMPOOL_DEVICE"):
        # Without a driver, `profile` ran the program on the simulated device for it.
        out.line(f"  (on this machine, without a GPU: run the program with {_simulated_environment()})")
    if args.json:
        out.emit_json(
            _recommend_document(dev, log, args.max_lead, repeats, runs, summary, prof, choice, None, passes)
        )
    return EXIT_OK


def _simulated_environment() -> str:
    """The environment that runs a program on the simulated device this process measured
    on: ``STREAMPOOL_DEVICE=sim`` and the ``STREAMPOOL_SIM_*`` variables that are set
    (not blank: the library reads a blank one as unset), quoted for a shell."""
    settings = ["STREAMPOOL_DEVICE=sim"]
    for name in (_env.CAPACITY, _env.DEVICES):
        value = os.environ.get(name, "").strip()
        if value:
            settings.append(f"{name}={shlex.quote(value)}")
    return " ".join(settings)


def _recommend_document(
    dev: Device,
    log: str,
    max_lead: float | None,
    repeats: int,
    runs: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    prof: recommend.Profile,
    choice: dict[str, Any] | None,
    error: str | None,
    passes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`recommend --json`'s document; ``choice`` None with ``error`` when nothing could be
    recommended (every candidate ran out of memory, or none could be measured here).
    ``passes``: how many times over each candidate's runs replayed the log."""
    return document(
        "recommend",
        dev,
        workload="replay",
        params={"log": log, "gap_scale": 0.0, "max_lead": max_lead, "passes": passes or {}},
        repeats=repeats,
        runs=_strip(runs),
        summary=summary,
        plots=[],
        profile=prof.as_json(),
        recommendation=choice,
        error=error,
    )


def _cmd_stress(args: argparse.Namespace, dev: Device) -> int:
    specs = _specs(args.resources)
    seconds = args.seconds if args.seconds is not None else 2.0 if args.quick else 10.0
    out = Output(args.json)
    reports = []
    _announce(out, dev)
    for spec in specs:
        out.line(f"stress {spec}: {seconds:g} s, {args.threads} threads x {args.streams} streams ...")
        if dev.sim is not None:  # each resource's races its own (the detector keeps the first 1000)
            dev.sim.clear_races()
        report = stress.run(
            make_resource(spec),
            seconds=seconds,
            threads=args.threads,
            streams=args.streams,
            max_size=args.max_size,
            seed=args.seed,
            sim=dev.sim,
        )
        reports.append({"resource": spec, **report})
        verdict = "OK" if report["ok"] else "NOTHING VERIFIED" if report["nothing_verified"] else "FAILED"
        out.line(
            f"  {verdict}: {report['operations']} operations, {report['allocations']} allocations "
            f"({report['refused']} refused: out of memory), {human_bytes(report['verified_bytes'])} "
            f"verified by kernels, {report['pending_frees']} freed with a kernel pending; race detector "
            + ("on" if report["race_detector"] else "off (a real GPU)")
        )
        for kind in ("corruptions", "overlaps", "races", "errors"):
            for text in report[kind]:
                out.line(f"  {kind[:-1]}: {text}")
    if args.json:
        out.emit_json(document("stress", dev, stress=reports))
    unverified = [r["resource"] for r in reports if r["nothing_verified"]]
    if unverified:
        print(
            f"streampool stress: nothing verified on {', '.join(unverified)}: no allocation was checked "
            "(every one refused, or none made): a smaller --max-size, more memory for the resource "
            "or more --seconds may let it run",
            file=sys.stderr,
        )
    if any(not r["ok"] and not r["nothing_verified"] for r in reports):
        return EXIT_CHECK_FAILED
    return EXIT_CANNOT_RUN if unverified else EXIT_OK


def _cmd_plot(args: argparse.Namespace, dev: Device) -> int:
    out = Output()
    t = _read_log(out, args.log, args.skip_malformed)
    target = args.output or f"{args.log}.png"
    if target.endswith(os.sep) or os.path.isdir(target):  # a directory: the log's name in it
        target = os.path.join(target, os.path.basename(args.log) + ".png")
    elif not os.path.splitext(target)[1]:
        target += ".png"  # what matplotlib writes for a name without a suffix; said so below
    if not os.path.isdir(os.path.dirname(target) or "."):
        raise _Fail(
            EXIT_BAD_INPUT, f"-o {args.output}: the directory {os.path.dirname(target)} does not exist"
        )
    plots._plt()  # before any work: a clear message when matplotlib is missing
    suffix = os.path.splitext(target)[1][1:].lower()
    formats = plots.file_formats()
    if suffix not in formats:
        raise _Fail(
            EXIT_USAGE,
            f"-o {args.output}: matplotlib writes no .{suffix} files; name one of "
            f"{', '.join('.' + f for f in sorted(formats))} (.png by default)",
        )
    candidate = make_resource(args.resource)
    # A resource that holds nothing beyond what is live (cuda, managed) reserves its live bytes.
    reserved = candidate.reserved if not candidate.reserves_live else None
    replayed = trace.sequential_replay(candidate.resource, t, reserved)
    if candidate.reserves_live:
        replayed["reserved"] = list(replayed["live"])
    plots.log_plot(t, replayed, candidate.spec, target, dev.simulated)
    note = " (simulated device)" if dev.simulated else ""
    out.line(f"wrote {target}{note}")
    if replayed["oom_events"]:
        print(
            f"streampool plot: {replayed['oom_events']} of the log's allocations ran out of memory on "
            f"{candidate.spec}: its live and reserved curve leaves them out (the recorded curves above "
            "it are whole); --resource with more memory replays them",
            file=sys.stderr,
        )
    return EXIT_OK


__all__ = ["HARNESS_EXTRA", "main"]
