"""Output: a rich table on a terminal (plain text when piped or without rich), progress
bars on a terminal, JSON with a versioned schema (``schema.json`` beside this file)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .. import __version__

#: The version of the ``--json`` document; a change that breaks readers bumps it.
SCHEMA_ID = "streampool.harness/2"
SCHEMA_PATH = Path(__file__).with_name("schema.json")
HARNESS_EXTRA = "pip install 'streampool[harness]'"

T = TypeVar("T")


def _rich() -> Any:
    try:
        import rich.console
        import rich.progress
        import rich.table
    except ImportError:
        return None
    import rich

    return rich


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_ns(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    return f"{ns / 1e6:.2f} ms"


def human_rate(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.1f}"


class Output:
    """Where a command's report goes: ``table``/``line`` print (rich on a terminal, plain
    text otherwise); with ``json_mode`` nothing but the final JSON goes to stdout (notes go
    to stderr)."""

    def __init__(self, json_mode: bool = False, stream: Any = None) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        rich = _rich()
        self.rich = rich if rich is not None and self.stream.isatty() and not json_mode else None
        self.console = rich.console.Console(file=self.stream) if self.rich else None
        if rich is None and self.stream.isatty() and not json_mode:
            print(f"(plain text: {HARNESS_EXTRA} for tables, progress bars and plots)", file=sys.stderr)

    def line(self, text: str = "") -> None:
        if self.json_mode:
            print(text, file=sys.stderr)
        elif self.console is not None:
            self.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A table: rich's on a terminal wide enough for every cell on one line (a header
        may wrap at its spaces), else plain text, whose lines a narrow terminal wraps
        whole: a number is never broken inside a cell."""
        if self.json_mode:
            return
        if self.console is not None and self.rich is not None and self._fits(columns, rows):
            from rich.markup import escape  # text such as "[simulated device]" is not markup

            table = self.rich.table.Table(title=escape(title))
            for i, c in enumerate(columns):
                table.add_column(
                    escape(c),
                    justify="left" if i == 0 else "right",
                    min_width=_cell_width(c, rows, i),
                    overflow="fold",
                )
            for r in rows:
                table.add_row(*map(escape, r))
            self.console.print(table)
            return
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print(title, file=self.stream)

        def fmt(r: Sequence[str]) -> str:
            return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))

        print(fmt(columns), file=self.stream)
        print("  ".join("-" * w for w in widths), file=self.stream)
        for r in rows:
            print(fmt(r), file=self.stream)
        print(file=self.stream)

    def _fits(self, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> bool:
        """Whether rich's table of ``rows`` fits the console with no cell wrapped: each
        column as wide as its widest cell (and its header's longest word), plus a space
        either side and a border between columns and at both ends."""
        assert self.console is not None
        widths = [_cell_width(c, rows, i) for i, c in enumerate(columns)]
        width: int = self.console.width
        return sum(widths) + 3 * len(widths) + 1 <= width

    def progress(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        """``items``, with a progress bar on stderr when that is a terminal and rich is here."""
        rich = _rich()
        if rich is None or not sys.stderr.isatty():
            yield from items
            return
        console = rich.console.Console(file=sys.stderr)
        with rich.progress.Progress(console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            for item in items:
                yield item
                bar.advance(task)

    def emit_json(self, document: dict[str, Any]) -> None:
        json.dump(document, self.stream, indent=2, sort_keys=False, default=_jsonable)
        self.stream.write("\n")


def _cell_width(header: str, rows: Sequence[Sequence[str]], i: int) -> int:
    """The width column ``i`` needs for its cells on one line each and its header's longest
    word (the header may wrap at its spaces)."""
    return max([len(r[i]) for r in rows] + [len(w) for w in header.split()] + [1])


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def document(command: str, device: Any, **body: Any) -> dict[str, Any]:
    """The ``--json`` document: schema id, command, version, time, device, then ``body``."""
    return {
        "schema": SCHEMA_ID,
        "command": command,
        "streampool_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device.as_json(),
        **body,
    }
