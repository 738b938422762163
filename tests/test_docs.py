"""The README is a five-minute read and the docs/ pages hold the rest (issue 25, item 6).

Checked here, each against a reference that is not the text under test: every relative link in README.md
and docs/*.md names a file that exists and, for a ``#fragment`` into a Markdown file, a heading of that file
(GitHub's heading slugs, restated below); the README stays short; its quick start is exactly the two
``quickstart.sh`` commands, which ``quickstart.sh`` really accepts and ``.ci/run`` really runs; every docs
page starts with the commands its reader runs; every number of the README's results table equals the ratio
in the benchmark JSON the row names; every ``CachedImageNet(...)`` example passes the cache by keyword;
and what code comments point at (``docs/x.md "Section"``, ``README "Section"``) exists.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200
# the pages by reader (issue 25): each must exist, be linked from the README and start with commands
PAGES = ("using-the-cache.md", "cluster.md", "deploy.md", "security.md", "training.md", "benchmarks.md",
         "internals.md")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!\!)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code and HTML comments blanked."""
    text = HTML_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(no, INLINE_CODE.sub("", line)) for no, line in prose_lines_raw(text)]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (letters, digits, ``_``,
    ``-`` and spaces kept), each space a hyphen. Restated from GitHub's behaviour, not from our text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())           # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)           # links keep their text
    text = text.lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading slug of a Markdown file, with GitHub's -1, -2 ... suffixes for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines_raw(path.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def prose_lines_raw(text: str) -> list[tuple[int, str]]:
    """Like ``prose_lines`` but inline code kept (a heading's code span is part of its slug)."""
    out, fenced = [], False
    for no, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def section(text: str, heading_prefix: str) -> str:
    """The body of the first ``## `` section whose heading starts with ``heading_prefix``."""
    m = re.search(rf"^## {re.escape(heading_prefix)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {heading_prefix}...'"
    return m.group(1)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1).strip(), m.group(2))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```\s*$", text, re.M | re.S)]


def test_the_docs_pages_exist_and_the_readme_links_each() -> None:
    readme = README.read_text(encoding="utf-8")
    linked = {t.split("#")[0] for _, line in prose_lines(readme) for t in LINK.findall(line)}
    for page in PAGES:
        assert (DOCS / page).is_file(), f"docs/{page} is missing"
        assert f"docs/{page}" in linked, f"README.md does not link docs/{page}"


def test_every_relative_link_resolves_to_a_file_and_heading() -> None:
    bad, checked = [], 0
    for md in markdown_files():
        for no, line in prose_lines(md.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):       # http:, https:, mailto: ...
                    continue
                checked += 1
                path_part, _, frag = target.partition("#")
                dest = (md.parent / path_part).resolve() if path_part else md
                where = f"{md.relative_to(ROOT)}:{no}: {target}"
                if not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                    bad.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    assert checked > 20, "the link scan found almost nothing: is the pattern broken?"
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slug_rules_on_known_github_anchors() -> None:
    # anchors as GitHub renders them for headings of this shape (the reference for the rule above)
    assert github_slug("Tiers, keys and the variant") == "tiers-keys-and-the-variant"
    assert github_slug("Scale: ImageNet's shape, three sizes (`python -m bench.scale`)") == \
        "scale-imagenets-shape-three-sizes-python--m-benchscale"
    assert github_slug("Gradient communication as DDP comm hooks — one line") == \
        "gradient-communication-as-ddp-comm-hooks--one-line"
    heading = "The paper's cluster on paper: is one 25 GbE link enough for samples *and* gradients?"
    assert github_slug(heading) == \
        "the-papers-cluster-on-paper-is-one-25-gbe-link-enough-for-samples-and-gradients"


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs"


def test_quick_start_is_exactly_the_two_commands() -> None:
    body = section(README.read_text(encoding="utf-8"), "Quick start")
    blocks = fenced_blocks(body)
    assert len(blocks) == 1, "the quick start has one command block"
    commands = [line.split("#", 1)[0].strip() for line in blocks[0][1].splitlines()]
    commands = [c for c in commands if c]
    assert commands == ["./quickstart.sh demo", "./quickstart.sh test"], f"the quick start runs {commands}"
    # ... and quickstart.sh really has those two subcommands (its case arms, not its comments)
    script = (ROOT / "quickstart.sh").read_text(encoding="utf-8")
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    for sub in ("demo", "test"):
        assert re.search(rf"^\s*{sub}\)\s*$", code, re.M), f"quickstart.sh has no '{sub})' branch"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert "EXTRAS=dali ./quickstart.sh test" in commands, ".ci/run no longer runs the README's test command"
    readme = README.read_text(encoding="utf-8")
    assert "./quickstart.sh test" in section(readme, "Quick start") and "EXTRAS=dali" in readme
    # the detail page says what CI runs, in the same words
    assert "`EXTRAS=dali ./quickstart.sh test`" in (DOCS / "using-the-cache.md").read_text(encoding="utf-8")
    assert "`EXTRAS=dali ./quickstart.sh test`" in (DOCS / "internals.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES)
def test_each_page_starts_with_the_commands_its_reader_runs(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    headings = [line for _, line in prose_lines_raw(text) if re.match(r"^#{1,6} ", line)]
    assert headings[0].startswith("# "), f"docs/{page}: the first heading is the page title"
    assert headings[1] == "## Commands", f"docs/{page}: the first section is '## Commands'"
    blocks = fenced_blocks(section(text, "Commands"))
    assert blocks and all(info in ("bash", "sh", "console") for info, _ in blocks), \
        f"docs/{page}: '## Commands' holds shell blocks"


def results_rows() -> list[list[str]]:
    body = section(README.read_text(encoding="utf-8"), "Results")
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("|")]
    assert rows and rows[0][:4] == ["against", "measured", "ratio (target)", "from"]
    return rows[2:]                       # header and separator dropped


def test_results_table_numbers_are_the_json_ratios() -> None:
    rows = results_rows()
    assert len(rows) >= 8
    names = set()
    for against, measured, ratio, src in rows:
        name = re.match(r"`([^`]+)`", ratio)
        path = re.fullmatch(r"`(bench/results/[a-z0-9_]+\.json)`", src)
        assert name and path, f"row '{against}': a ratio name and a bench/results JSON are required"
        names.add(name.group(1))
        ratios = json.loads((ROOT / path.group(1)).read_text(encoding="utf-8"))["ratios"]
        assert name.group(1) in ratios, f"{path.group(1)} has no ratio {name.group(1)}"
        shown = re.match(r"(-?[0-9][0-9,]*(?:\.([0-9]+))?)", measured)
        assert shown, f"row '{against}': the measured column starts with the number"
        digits = len(shown.group(2) or "")
        value = float(shown.group(1).replace(",", ""))
        assert round(ratios[name.group(1)], digits) == pytest.approx(value), \
            f"row '{against}': README says {value}, {path.group(1)} says {ratios[name.group(1)]}"
    # the peers the issue names are all in the table
    for ratio in ("warm_vs_naive", "warm_vs_ffcv_raw", "warm_vs_dali", "first_epoch_vs_ffcv_convert",
                  "e2e_full_vs_naive", "hitopk_vs_dense_1gbit"):
        assert ratio in names, f"the README's results table lacks {ratio}"


def test_overlap_table_numbers_are_the_json_ratios() -> None:
    """Every cell of the README's --overlap table is overlap.json's ratio for its row's method and its
    column's mode and link, rounded as shown (the column headings name them)."""
    body = section(README.read_text(encoding="utf-8"), "Overlapping communication")
    ratios = json.loads((ROOT / "bench/results/overlap.json").read_text(encoding="utf-8"))["ratios"]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    templates = {"`async`, 1 Gbit/s": "overlap_{m}_async_vs_sync",
                 "`cross`, 1 Gbit/s": "overlap_{m}_cross_vs_sync",
                 "`async`, 0.2 Gbit/s": "overlap_{m}_async_vs_sync_0.2gbit",
                 "`async`, unshaped": "overlap_{m}_async_vs_sync_fast",
                 "best / bound, 1 Gbit/s": "overlap_vs_bound_{m}",
                 "ceiling, 1 Gbit/s": "overlap_{m}_model_ceiling"}
    assert head[0] == "`--comm`" and head[1:] == list(templates), head
    methods = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        method = cells[0].strip("`")
        methods.append(method)
        for col, cell in zip(head[1:], cells[1:]):
            want = ratios[templates[col].format(m=method)]
            assert float(cell.rstrip("x")) == pytest.approx(round(want, 2)), (method, col, cell, want)
    from trainer.comm.names import METHOD_CHOICES

    assert methods == list(METHOD_CHOICES)


def test_migration_section_is_present() -> None:
    assert re.search(r"^## Migrating from ImageFolder$", README.read_text(encoding="utf-8"), re.M)


def _cached_imagenet_calls(code: str) -> list[ast.Call] | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "CachedImageNet"]


def test_cached_imagenet_examples_pass_the_cache_by_keyword() -> None:
    bad, seen = [], 0
    for md in markdown_files():
        for info, code in fenced_blocks(md.read_text(encoding="utf-8")):
            if info not in ("python", "py"):
                continue
            calls = _cached_imagenet_calls(code)
            if calls is None:                   # not plain Python (an excerpt): the positional form by eye
                if re.search(r"CachedImageNet\(\s*[^,()]+,\s*[\"'][a-z+]+://", code):
                    bad.append(f"{md.relative_to(ROOT)}: a cache URL passed positionally")
                continue
            for call in calls:
                seen += 1
                # ImageFolder's positionals (root, transform, ...) are fine; a cache URL string is not
                for arg in call.args[1:]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        bad.append(f"{md.relative_to(ROOT)}: a string passed positionally after the root "
                                   "(the cache is keyword-only: cache=...)")
    assert seen >= 2, "no CachedImageNet example found: is the scan broken?"
    assert not bad, "\n".join(bad)


def test_what_code_comments_point_at_exists() -> None:
    pointer = re.compile(r"(README|docs/[a-z_-]+\.md)(?:'s)? \"([^\"]+)\"")
    bad, seen = [], 0
    for pkg in ("datacache", "client", "cache_daemon", "trainer", "bench", "tests", ".ci"):
        for path in sorted((ROOT / pkg).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", "") or "data" in path.parts \
                    or path.name == "test_docs.py":
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for doc, name in pointer.findall(text):
                seen += 1
                target = README if doc == "README" else ROOT / doc
                if not target.is_file():
                    bad.append(f"{path.relative_to(ROOT)}: {doc} does not exist")
                    continue
                page = target.read_text(encoding="utf-8")
                titles = [line for _, line in prose_lines_raw(page) if line.startswith("#")]
                titles += re.findall(r"\*\*([^*]+)\*\*", page)
                if not any(name.lower() in t.lower() for t in titles):
                    bad.append(f"{path.relative_to(ROOT)}: {doc} has no heading or bold title '{name}'")
            for doc in re.findall(r"\bdocs/([a-z_-]+\.md)", text):
                if not (DOCS / doc).is_file():
                    bad.append(f"{path.relative_to(ROOT)}: docs/{doc} does not exist")
    assert seen, "no pointer found: is the pattern broken?"
    assert not bad, "\n".join(bad)
