"""The Python examples of README.md and docs/ (but docs/multi-gpu.md's, which
tests/test_multi_device.py runs on two simulated devices), run verbatim, each in a fresh
interpreter.

Every ```python block in those pages is preceded by a marker comment saying where it runs:

* ``<!-- readme-test: sim -->``: on the simulated device (``STREAMPOOL_DEVICE=sim``);
* ``<!-- readme-test: anywhere -->``: with ``STREAMPOOL_DEVICE`` unset (the block enters a
  simulated device itself);
* ``<!-- readme-test: gpu MODULE... -->``: on a GPU, with the named modules installed (a
  ``gpu`` test, run by the GPU suite).

A block without a marker fails the test, so that no example goes unrun.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
PAGES = [
    "README.md",
    "docs/choosing-a-resource.md",
    "docs/frameworks.md",
    "docs/harness.md",
    "docs/ipc.md",
    "docs/rmm-migration.md",
]
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- readme-test: (\w+)((?: [\w.]+)*) -->\n\n?\Z")
MODES = ("sim", "anywhere", "gpu")


class Example(NamedTuple):
    page: str
    line: int
    mode: str
    modules: tuple[str, ...]
    code: str


def examples(text: str, page: str = "README.md") -> list[Example]:
    """The python blocks of ``text`` (of ``page``) with their markers; a block without one
    raises."""
    found = []
    for fence in FENCE.finditer(text):
        line = text.count("\n", 0, fence.start()) + 1
        marker = MARKER.search(text, 0, fence.start())
        if marker is None or marker.group(1) not in MODES:
            raise ValueError(
                f"{page} line {line}: a python block needs a marker such as <!-- readme-test: sim -->"
            )
        found.append(Example(page, line, marker.group(1), tuple(marker.group(2).split()), fence.group(1)))
    return found


EXAMPLES = [ex for page in PAGES for ex in examples((README.parent / page).read_text(encoding="utf-8"), page)]


def _params() -> list[object]:
    params: list[object] = []
    for ex in EXAMPLES:
        marks = [pytest.mark.gpu] if ex.mode == "gpu" else []
        params.append(pytest.param(ex, id=f"{Path(ex.page).stem}-line{ex.line}-{ex.mode}", marks=marks))
    return params


def test_every_block_has_a_marker_and_some_run_without_a_gpu() -> None:
    assert {ex.mode for ex in EXAMPLES} == set(MODES)
    with pytest.raises(ValueError, match="line 3: a python block needs a marker"):
        examples("intro\n\n```python\nprint(1)\n```\n")


@pytest.mark.nosim
@pytest.mark.parametrize("example", _params())
def test_readme_example_runs(example: Example, tmp_path: Path) -> None:
    for module in example.modules:
        pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items() if k != "STREAMPOOL_DEVICE"}
    if example.mode == "sim":
        env["STREAMPOOL_DEVICE"] = "sim"
    out = subprocess.run(
        [sys.executable, "-c", example.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"{example.page} line {example.line} failed:\n{out.stderr}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.nosim
@pytest.mark.parametrize("page", ["docs/README.md", "docs/choosing-a-resource.md", "docs/multi-gpu.md"])
def test_documentation_links_point_at_files_and_headings_that_exist(page: str) -> None:
    root = README.parent
    source = root / page
    links = LINK.findall(source.read_text(encoding="utf-8"))
    assert links, f"{page} links nowhere"
    for target, anchor in links:
        path = (source.parent / target).resolve()
        assert path.exists(), f"{page} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_anchor(h) for h in headings}, f"{page}: no heading #{anchor} in {target}"


def _layout_block() -> str:
    text = (README.parent / "DEVELOPERS.md").read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


@pytest.mark.nosim
def test_developers_layout_names_every_folder_and_crate_source_file() -> None:
    root = README.parent
    layout = _layout_block()
    ignored = {line.strip().strip("/") for line in (root / ".gitignore").read_text().splitlines()}
    for entry in sorted(root.iterdir()):
        if (
            not entry.is_dir()
            or entry.name in ignored
            or (entry.name.startswith(".") and entry.name != ".ci")
        ):
            continue
        assert f"{entry.name}/" in layout, f"DEVELOPERS.md's layout misses {entry.name}/"
    for crate in ("rust/streampool", "rust/streampool-py"):
        for entry in sorted((root / crate / "src").iterdir()):
            name = f"src/{entry.name}" + ("/" if entry.is_dir() else "")
            assert name in layout, f"DEVELOPERS.md's layout misses {crate}/{name}"


@pytest.mark.nosim
def test_the_guides_tables_are_read_from_the_committed_json() -> None:
    """docs/choosing-a-resource.md: every marked table is what scripts/guide_tables.py
    renders from its JSON document in benchmarks/guide/, and every document is there."""
    guide = README.parent / "docs" / "choosing-a-resource.md"
    text = guide.read_text(encoding="utf-8")
    named = re.findall(r"^<!-- table: ([\w.-]+\.json) -->$", text, re.MULTILINE)
    assert len(named) >= 6, named
    for name in named:
        assert (README.parent / "benchmarks" / "guide" / name).is_file(), name
    done = subprocess.run(
        [sys.executable, str(README.parent / "scripts" / "guide_tables.py"), "--check", str(guide)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def _guide_tables() -> Any:
    sys.path.insert(0, str(README.parent / "scripts"))
    try:
        import guide_tables
    finally:
        sys.path.pop(0)
    return guide_tables


@pytest.mark.nosim
def test_the_guide_marks_rows_of_a_measurement_stopped_part_way() -> None:
    guide_tables = _guide_tables()
    window = README.parent / "benchmarks" / "guide" / "window.json"
    doc = json.loads(window.read_text())
    whole = guide_tables.bench_table(doc)
    assert "stopped" not in "\n".join(whole)
    last = doc["summary"][-1]
    last["repeats"] = 1
    cut = guide_tables.bench_table(doc)
    changed = [line for line in cut if line not in whole]
    assert len(changed) == 1 and changed[0].startswith(f"| `{last['resource']}` |")
    assert changed[0].count(f"(1 of {doc['repeats']} runs: stopped)") == 1
    # A resource and a thread count that no run reached: shown, and said to be stopped.
    doc["summary"] = [row for row in doc["summary"] if row["threads"] != 16 and row["resource"] != "async"]
    doc["interrupted"] = True
    doc["planned"] = {"resources": ["async", "pool(async)"], "threads": [1, 4, 16]}
    stopped = guide_tables.bench_table(doc)
    assert stopped[0].endswith("| 16 threads |")
    assert stopped[2].startswith("| `async` |") and stopped[2].count("stopped before its runs") == 3
    assert stopped[3].startswith("| `pool(async)` |") and stopped[3].endswith("| stopped before its runs |")
    # Stopped after every run at one thread of a measurement of two: two columns still.
    doc["summary"] = [row for row in json.loads(window.read_text())["summary"] if row["threads"] == 1]
    doc["planned"] = {"resources": ["async", "pool(async)", "stats(async)"], "threads": [1, 4]}
    two = guide_tables.table_of(doc)
    assert two[0] == "| resource | 1 thread | 4 threads |"
    assert two[4] == "| `stats(async)` | stopped before its runs | stopped before its runs |"


@pytest.mark.nosim
def test_the_guide_shows_no_live_peak_that_a_replay_on_threads_did_not_measure() -> None:
    """Documents of earlier versions gave a trace replay's peak on several threads as the
    log's in recorded order (one thread's, for a generated log): the guide shows "—" there,
    and the figures of replays that measured their own peak."""
    guide_tables = _guide_tables()
    doc = json.loads((README.parent / "benchmarks" / "guide" / "window.json").read_text())
    assert guide_tables.live_unmeasured(doc) == set()  # the committed runs measured their own
    assert "\u2014 MiB" not in "\n".join(guide_tables.bench_table(doc))
    for run in doc["runs"]:
        del run["peak_live_measured"]  # as earlier versions wrote them
    unmeasured = guide_tables.live_unmeasured(doc)
    assert unmeasured and {t for _, t in unmeasured} == {4, 16}
    pool = next(r for r in guide_tables.bench_table(doc) if r.startswith("| `pool(async)` |"))
    one, four, sixteen = pool.strip("|").split("|")[1:]
    assert "\u2014" not in one and "/\u2014 MiB" in four and "/\u2014 MiB" in sixteen
