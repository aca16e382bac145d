"""PNG plots (matplotlib, from the ``streampool[harness]`` extra): throughput against
threads and latency distributions (or, where a run kept no per-call times, percentiles)
from ``bench``; live and reserved bytes over time per
stream and per thread, and latency histograms, from a log (``plot``). Every plot made on
the simulated device says so in its title."""

from __future__ import annotations

import errno
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .output import HARNESS_EXTRA
from .trace import ALLOCATE, Trace

__all__ = ["PlotsUnavailableError", "bench_plots", "latency_plot", "log_plot", "writable_dir"]


class PlotsUnavailableError(RuntimeError):
    """matplotlib is not installed (the message names the extra to install)."""


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailableError(f"plots need matplotlib: {HARNESS_EXTRA}") from None
    return plt


def file_formats() -> set[str]:
    """The file suffixes matplotlib saves a figure as (png, pdf, svg, ...)."""
    _plt()
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def writable_dir(out_dir: str) -> None:
    """Makes ``out_dir`` (and its parents) and checks that a file can be written there, so
    that a run is not measured for plots that cannot be saved; OSError when not."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir):
        pass


def _legend(ax: Any, fontsize: str) -> None:
    """A legend where the panel has labelled lines (none where, say, every allocation ran
    out of memory: matplotlib would warn)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def _log_bins(samples: list[int], n: int = 60) -> list[float]:
    lo, hi = max(1, min(samples)), max(2, max(samples))
    return [lo * (hi / lo) ** (i / n) for i in range(n + 1)]


def _title(text: str, simulated: bool) -> str:
    return f"{text}\n(simulated device: not GPU figures)" if simulated else text


def _save(plt: Any, fig: Any, path: str, dpi: int = 120) -> str:
    """Writes ``fig`` to ``path`` (laid out) and closes it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bench_plots(
    workload: str, summary: list[dict[str, Any]], runs: list[dict[str, Any]], out_dir: str, simulated: bool
) -> list[str]:
    """Throughput (median, min-max bars) against threads per resource beside the memory it
    cost (peak reserved over peak live bytes, where the resource says), and the allocate
    latency distribution per resource at the largest thread count; returns the files."""
    plt = _plt()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    files = []
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, spec in enumerate(dict.fromkeys(r["resource"] for r in summary)):
        rows = [r for r in summary if r["resource"] == spec]
        xs = [r["threads"] for r in rows]
        med = [r["throughput"]["median"] for r in rows]
        lo = [m - r["throughput"]["min"] for m, r in zip(med, rows)]
        hi = [r["throughput"]["max"] - m for m, r in zip(med, rows)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=spec, linestyle=_style(i))
        held = [
            (r["threads"], r["peak_reserved_bytes"] / r["peak_live_bytes"])
            for r in rows
            if r.get("peak_reserved_bytes") is not None and r.get("peak_live_bytes")
        ]
        if held:
            mem.plot(*zip(*held), marker="o", label=spec, linestyle=_style(i))
    ticks = sorted({r["threads"] for r in summary})
    for a in (ax, mem):
        a.set_xlabel("producer/consumer pairs" if workload == "pipeline" else "threads")
        a.set_xscale("log", base=2)
        a.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_ylabel(summary[0]["unit"] if summary else "")
    mem.set_ylabel("peak reserved / peak live bytes")
    _legend(ax, "small")
    _legend(mem, "small")
    ax.set_title(_title(f"{workload}: throughput (median, min-max)", simulated))
    mem.set_title("the memory it cost (largest peaks of the runs)")
    files.append(_save(plt, fig, str(Path(out_dir) / f"{workload}-throughput.png")))

    top = max((r["threads"] for r in runs), default=1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kind = latency_plot(ax, [r for r in runs if r["threads"] == top])
    _legend(ax, "small")
    noun = "pair(s)" if workload == "pipeline" else "thread(s)"
    ax.set_title(_title(f"{workload}: allocate latency {kind} at {top} {noun}", simulated))
    files.append(_save(plt, fig, str(Path(out_dir) / f"{workload}-latency.png")))
    return files


def _style(i: int) -> str:
    """The line style of the i-th series: dashed once the 10 default colours come round."""
    return "-" if i < 10 else "--"


# The percentiles every run reports, and where a percentile plot puts them.
_PERCENTILES = (("p50", "50"), ("p90", "90"), ("p99", "99"), ("p999", "99.9"), ("max", "max"))


def latency_plot(ax: Any, runs: list[dict[str, Any]]) -> str:
    """Draws the allocate latencies of ``runs`` on ``ax``, one series per resource: a
    histogram of every call where the runs kept them (the Python drivers), else each
    percentile's median over the runs (the native drivers report percentiles only).
    Returns what was drawn: "distribution" or "percentiles"."""
    specs = list(dict.fromkeys(r["resource"] for r in runs))
    samples = {
        spec: [
            x
            for r in runs
            if r["resource"] == spec
            for x in ((r.get("_latencies") or {}).get("allocate") or [])
        ]
        for spec in specs
    }
    if any(samples.values()):
        for spec, xs in samples.items():
            if xs:
                ax.hist(xs, bins=_log_bins(xs), histtype="step", label=spec, log=True)
        ax.set_xscale("log")
        ax.set_xlabel("allocate latency (ns)")
        ax.set_ylabel("calls")
        return "distribution"
    positions = range(len(_PERCENTILES))
    for i, spec in enumerate(specs):
        mine = [r["allocate"] for r in runs if r["resource"] == spec]
        ys = [statistics.median(p[key] for p in mine) for key, _ in _PERCENTILES]
        ax.plot(positions, ys, marker="o", label=spec, linestyle=_style(i))
    ax.set_xticks(list(positions), [label for _, label in _PERCENTILES])
    ax.set_yscale("log")
    ax.set_xlabel("percentile (median over the runs)")
    ax.set_ylabel("allocate latency (ns)")
    return "percentiles"


def _steps(trace: Trace, key: int) -> dict[int, tuple[list[float], list[int]]]:
    """Live bytes over time (s) per thread (``key`` 3) or stream (4): a free is charged to
    the thread or stream that made the allocation (the same address, matched when the log
    was read), wherever it was freed, so no level goes below zero."""
    series: dict[int, tuple[list[float], list[int]]] = {}
    level: dict[int, int] = {}
    owner: dict[int, int] = {}  # alloc_id -> the allocation's thread or stream
    for r in trace.records:
        if r[5] == ALLOCATE:
            k = owner[r[2]] = r[key]
            level[k] = level.get(k, 0) + r[1]
        else:
            k = owner.pop(r[2], r[key])
            level[k] = level.get(k, 0) - r[1]
        xs, ys = series.setdefault(k, ([], []))
        xs.append(r[0] / 1e9)
        ys.append(level[k])
    return series


# The most streams or threads a log's plot draws a line for (the title says how many there were).
_MOST_LINES = 16


def log_plot(trace: Trace, replayed: dict[str, Any], spec: str, out: str, simulated: bool) -> str:
    """One PNG: live bytes over time per stream and per thread, total live against the
    bytes ``spec`` reserved when the log was replayed on it in recorded order
    (``replayed``: times_s, live, reserved, latencies_ns), and its latency histograms."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, key, name in ((axes[0][0], 4, "stream"), (axes[0][1], 3, "thread")):
        handles = trace.stream_handles if key == 4 else trace.thread_ids
        steps = sorted(_steps(trace, key).items())
        for k, (xs, ys) in steps[:_MOST_LINES]:
            label = f"{name} {handles[k]:#x}" if key == 4 and k < len(handles) else f"{name} {k}"
            ax.step(xs, [y / 2**20 for y in ys], where="post", label=label)
        shown = f", the first {_MOST_LINES} of {len(steps)}" if len(steps) > _MOST_LINES else ""
        ax.set_title(f"live MiB per {name} (recorded times{shown})")
        ax.set_xlabel("s")
        _legend(ax, "x-small")
    ax = axes[1][0]
    ax.step(range(len(replayed["live"])), [y / 2**20 for y in replayed["live"]], where="post", label="live")
    if any(v is not None for v in replayed["reserved"]):
        ax.step(
            range(len(replayed["reserved"])),
            [(y or 0) / 2**20 for y in replayed["reserved"]],
            where="post",
            linestyle="--",
            label=f"reserved ({spec})",
        )
    failed = replayed.get("oom_events", 0)
    left_out = f"\n({failed} allocations out of memory, left out)" if failed else ""
    ax.set_title(f"live and reserved MiB, replayed on {spec}{left_out}")
    ax.set_xlabel("event")
    _legend(ax, "small")
    ax = axes[1][1]
    for name, samples in replayed["latencies_ns"].items():
        if samples:
            ax.hist(samples, bins=_log_bins(samples), histtype="step", log=True, label=name)
    ax.set_xscale("log")
    ax.set_title(f"latency on {spec} (ns)")
    _legend(ax, "small")
    fig.suptitle(_title(f"allocation log: {trace.events} events", simulated))
    return _save(plt, fig, out, dpi=110)
