"""Renders the tables of docs/choosing-a-resource.md from the harness's JSON documents in
benchmarks/guide/, so that every figure in the guide is read from a committed file.

    python3 scripts/guide_tables.py benchmarks/guide/window.json       # one table, printed
    python3 scripts/guide_tables.py --check docs/choosing-a-resource.md  # the doc's tables match
    python3 scripts/guide_tables.py --write docs/choosing-a-resource.md  # rewrite them

In the doc, a table follows a marker line ``<!-- table: NAME.json [NAME.json ...] -->``
(files under benchmarks/guide/; several for a table of `recommend` documents, a row each)
and ends at the first line that does not start with ``|``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "benchmarks" / "guide"
MARKER = re.compile(r"^<!-- table: ((?:[\w.-]+\.json ?)+) -->$")
MIB = 1 << 20
DASH = "\u2013"  # the en dash of a range, as the guide writes it


def number(x: float) -> str:
    """Three significant figures at most, two decimals below 10."""
    if x < 10:
        return f"{x:.2f}"
    if x < 100:
        return f"{x:.1f}"
    return f"{x:.0f}"


def duration(ns: float) -> str:
    if ns < 1_000_000:
        us = ns / 1000
        return f"{us:.1f} µs" if us < 10 else f"{us:.0f} µs"
    ms = ns / 1_000_000
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"


def size(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def rate(stats: dict[str, float], unit: str) -> str:
    scale, suffix = {"chunks/s": (1e3, "k"), "bytes/s": (1e9, "")}.get(unit, (1e6, ""))
    lo, mid, hi = (stats[k] / scale for k in ("min", "median", "max"))
    return f"{number(mid)}{suffix} ({number(lo)}{DASH}{number(hi)}{suffix})"


def memory(row: dict[str, Any], unit: str = " MiB") -> str | None:
    """Peak reserved / peak live MiB ("—" for live bytes not measured), or None where the
    resource reports no reserved bytes."""
    reserved, live = row.get("peak_reserved_bytes"), row.get("peak_live_bytes")
    if reserved is None or not (live or row.get("live_unmeasured")):
        return None
    shown = "—" if row.get("live_unmeasured") else f"{live / MIB:.0f}"
    return f"{reserved / MIB:.0f}/{shown}{unit}"


def live_unmeasured(doc: dict[str, Any]) -> set[tuple[str, int]]:
    """The (resource, threads) of a trace replay on several threads whose runs did not
    measure the bytes live at once: documents of earlier versions gave the log's peak in
    recorded order there (``peak_live_measured`` false or missing), one thread's for a
    generated log."""
    if doc.get("workload") not in ("random", "window", "replay"):
        return set()
    rows = {(r["resource"], r["threads"]) for r in doc["runs"] if r["threads"] > 1}
    measured = {(r["resource"], r["threads"]) for r in doc["runs"] if r.get("peak_live_measured")}
    return rows - measured


def held_mib(row: dict[str, Any]) -> str:
    """`memory` without its unit, with "—" for what the row does not report."""
    live = row.get("peak_live_bytes")
    if not live:
        return "—"
    return memory(row, unit="") or f"—/{live / MIB:.0f}"


def bench_cell(row: dict[str, Any], planned: int) -> str:
    """A row's figures; ``planned``: the runs each row was to have (a measurement that was
    stopped part-way, ``"interrupted"``, has fewer in some rows, and the cell says so)."""
    parts = [rate(row["throughput"], row["unit"])]
    if row["repeats"] < planned:
        parts[0] += f" ({row['repeats']} of {planned} runs: stopped)"
    # Larger than memory (bytes/s) and the pipeline (chunks/s): the allocator's share, and
    # for the pipeline its longest call; the others: the 99th percentile allocation.
    if row["unit"] in ("bytes/s", "chunks/s"):
        parts.append(f"{row['alloc_share']['median'] * 100:.0f} %")
        if row["unit"] == "chunks/s":
            parts.append(duration(row["longest_call_ns"]))
    else:
        parts.append(duration(row["allocate"]["p99"]))
    mem = memory(row)
    if mem:
        parts.append(mem)
    if row.get("oom_events"):
        parts.append(f"{row['oom_events']} out of memory")
    if row.get("mismatches"):
        parts.append(f"{row['mismatches']} WRONG")
    return "; ".join(parts)


def _planned(doc: dict[str, Any]) -> dict[str, list[Any]]:
    """What a measurement stopped part-way (``"interrupted"``) was to run; nothing for a
    whole one."""
    if doc.get("interrupted") and "planned" in doc:
        return dict(doc["planned"])
    return {"resources": [], "threads": []}


def bench_table(doc: dict[str, Any]) -> list[str]:
    """Resources down, thread counts (pairs for the pipeline) across."""
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    unmeasured = live_unmeasured(doc)
    for row in doc["summary"]:
        if (row["resource"], row["threads"]) in unmeasured:
            row = row | {"peak_live_bytes": None, "live_unmeasured": True}
        rows.setdefault(row["resource"], {})[row["threads"]] = row
    counts = sorted({t for by in rows.values() for t in by})
    missing = "—"
    if _planned(doc)["resources"]:  # stopped part-way: what it did not run
        counts = sorted({*counts, *_planned(doc)["threads"]})
        rows = {r: rows.get(r, {}) for r in [*_planned(doc)["resources"], *rows]}
        missing = "stopped before its runs"
    noun = "pair" if doc["workload"] == "pipeline" else "thread"
    head = [f"{t} {noun}{'' if t == 1 else 's'}" for t in counts]
    lines = ["| resource | " + " | ".join(head) + " |", "|---" * (len(counts) + 1) + "|"]
    for resource, by in rows.items():
        cells = [bench_cell(by[t], doc["repeats"]) if t in by else missing for t in counts]
        lines.append(f"| `{resource}` | " + " | ".join(cells) + " |")
    return lines


def bench_table_one_column(doc: dict[str, Any]) -> list[str]:
    """A workload measured at one thread count: a row per resource."""
    unit = {"bytes/s": "GB/s"}.get(doc["summary"][0]["unit"], doc["summary"][0]["unit"])
    lines = [
        f"| resource | {unit}, median (min{DASH}max); allocator share; peak reserved / peak live |",
        "|---|---|",
    ]
    lines += [f"| `{row['resource']}` | {bench_cell(row, doc['repeats'])} |" for row in doc["summary"]]
    shown = {row["resource"] for row in doc["summary"]}
    lines += [f"| `{r}` | stopped before its runs |" for r in _planned(doc)["resources"] if r not in shown]
    return lines


def recommend_table(docs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """A row per profiled program: what it does, the choice, its margin, the figures: the
    median speed of the choice and of `async`, and beside it the peak reserved / peak live
    MiB of each (the most over the repeats; "—" for reserved bytes a resource cannot report)."""
    lines = [
        "| program | what it does | choice | margin over the runner-up | M events/s: choice, `async` "
        "| peak reserved / peak live MiB: choice, `async` |",
        "|---|---|---|---|---|---|",
    ]
    for name, doc in docs:
        prof, rec = doc["profile"], doc["recommendation"]
        rates = {row["resource"]: row["throughput"]["median"] / 1e6 for row in doc["summary"]}
        held = {row["resource"]: held_mib(row) for row in doc["summary"]}
        what = (
            f"{prof['threads']} thread{'s' * (prof['threads'] != 1)}, {prof['streams']} "
            f"stream{'s' * (prof['streams'] != 1)}, {prof['allocations']:,} allocations of "
            f"{size(prof['size_p50'])} at the median"
        )
        margin = f"{1 + rec['margin']:.1f} times `{rec['runner_up']}`" + (
            " (within noise)" if rec["within_noise"] else ""
        )
        program = name.removeprefix("recommend-").removesuffix(".json")
        lines.append(
            f"| `{program}.py` | {what} | `{rec['choice']}` | {margin} | "
            f"{number(rates[rec['choice']])}, {number(rates['async'])} | "
            f"{held[rec['choice']]}, {held['async']} |"
        )
    return lines


def stress_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| resource | operations | allocations | checked by kernels | corruptions, overlaps, errors, races |"
    ]
    lines.append("|---|---|---|---|---|")
    for r in doc["stress"]:
        bad = ", ".join(str(len(r[k])) for k in ("corruptions", "overlaps", "errors", "races"))
        lines.append(
            f"| `{r['resource']}` | {r['operations']:,} | {r['allocations']:,} | "
            f"{r['verified_bytes'] / (1 << 30):.1f} GiB | {bad} |"
        )
    return lines


def table(names: list[str]) -> list[str]:
    docs = [(name, json.loads((GUIDE / name).read_text())) for name in names]
    commands = {doc.get("command") for _, doc in docs}
    if commands == {"recommend"}:
        return recommend_table(docs)
    if len(docs) != 1:
        raise SystemExit(f"{names}: several files make a table of `recommend` documents only")
    name, doc = docs[0]
    return table_of(doc, name)


def table_of(doc: dict[str, Any], name: str = "the document") -> list[str]:
    """The table of one `bench` or `stress` document."""
    if doc.get("command") == "stress":
        return stress_table(doc)
    if doc.get("command") == "bench":
        if len({row["threads"] for row in doc["summary"]} | set(_planned(doc)["threads"])) == 1:
            return bench_table_one_column(doc)
        return bench_table(doc)
    raise SystemExit(f"{name}: no table for a {doc.get('command')!r} document")


def rendered(text: str) -> str:
    """`text` with every marked table rendered again from its JSON file."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        i += 1
        if m:
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            out.extend(table(m.group(1).split()))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a harness JSON document, or the doc with --check/--write")
    ap.add_argument("--check", action="store_true", help="exit 1 when the doc's tables differ from the JSON")
    ap.add_argument("--write", action="store_true", help="rewrite the doc's tables from the JSON")
    args = ap.parse_args()
    if not (args.check or args.write):
        print("\n".join(table([str(args.path.resolve().relative_to(GUIDE))])))
        return 0
    text = args.path.read_text()
    new = rendered(text)
    if args.write:
        args.path.write_text(new)
        return 0
    if new != text:
        print(f"{args.path}: its tables differ from benchmarks/guide/ (run with --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
