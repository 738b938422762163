"""Production modules carry no benchmark figures: measured numbers live in bench/results
(NOTES.md and the JSON runs), the code keeps only the reasoning and a pointer."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("datacache", "client", "cache_daemon", "trainer")
FIGURE = re.compile(r"[0-9]+(\.[0-9]+)? ?(ms|µs|us|samples/s|images/s|MB/s|GB/s|x faster)\b")
# Lines that match the pattern without being measurements: exit-code lists ("2 usage"), a sample
# of the training log's format, and the cost model's hardware assumptions (model inputs taken from
# the paper and vendor specifications, not measured here).
ALLOWED = {
    ("datacache/cli.py", "Exit codes:"),
    ("trainer/cli.py", "Exit codes:"),
    ("trainer/metrics.py", "samples/s  data-wait"),
    ("trainer/comm/cost_model.py", "# "),
}


def test_no_benchmark_figures_in_production_modules() -> None:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if FIGURE.search(line) and not any(rel == f and m in line for f, m in ALLOWED):
                    found.append(f"{rel}:{no}: {line.strip()}")
    assert not found, "benchmark figures belong in bench/results/NOTES.md:\n" + "\n".join(found)


def test_notes_sections_the_code_points_to_exist() -> None:
    notes = (ROOT / "bench" / "results" / "NOTES.md").read_text(encoding="utf-8")
    anchors = {m.group(1) for m in re.finditer(r"^## ([a-z-]+)", notes, re.M)}
    refs = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            refs |= set(re.findall(r"bench/results/NOTES\.md#([a-z-]+)", path.read_text(encoding="utf-8")))
    assert refs and refs <= anchors, f"missing NOTES.md sections: {sorted(refs - anchors)}"
