"""The docs are reference: each page short enough to read, stating what is true now (history lives in
git), and every relative link in them leads to a file of the repository (and a heading of it)."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINKED = [ROOT / "README.md", *PAGES]
MAX_LINES = 700

# Phrases that tell how a page came to be rather than what is true: the machine a run was lent, the time
# left for it, what to run next, the tree a number was compared with. Each was in the docs before they
# were rewritten as reference; a measured table names its command, date and machine instead.
NARRATION = [
    r"\bthis session\b",
    r"\b(next|device|this|last) session\b",
    r"\blease\b",
    r"\bbudget allowed\b",
    r"\bdevice time\b",
    r"\bnext time\b",
    r"\bthe tree at\b",
    r"\b(was|were) lent\b",
    r"\bthis work('s)?\b",
    r"\bnot done yet\b",
    r"\bas they land\b",
    r"\bbusy day\b",
]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def prose(text: str) -> str:
    """The page with its code blocks blanked (their lines kept, so line numbers hold): a path in a command
    or an output quoted there is not a link, and a `# comment` there is not a heading."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set:
    found, seen = set(), {}
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_is_at_most_700_lines(page):
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{page.name}: {lines} lines; split it by topic"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_does_not_narrate(page):
    text = page.read_text()  # code blocks too: a command's comment narrates as well as prose does
    found = [(text[: m.start()].count("\n") + 1, m.group(0))
             for pattern in NARRATION for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{page.name}: narration at (line, phrase) {sorted(found)}"


def relative_links(page: Path):
    for m in LINK.finditer(prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        yield target


@pytest.mark.parametrize("page", LINKED, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_sees_links_headings_and_code():
    """The helpers the tests above rely on: a link with a title or an anchor, a heading's anchor, and a
    fenced block left out (a path in a command there is not a link)."""
    text = "see [a](x.md#b-c) and ![p](../r/p.png)\n```\n[not](a/link.md)\n```\n"
    assert [m.group(1) for m in LINK.finditer(prose(text))] == ["x.md#b-c", "../r/p.png"]
    assert slug("`bench --concurrency`: the auto policy (B = 1..8)") == "bench---concurrency-the-auto-policy-b--18"
    assert slug("Oracle acceptance and the verify pass on CUDA (27B shape, H200)") == \
        "oracle-acceptance-and-the-verify-pass-on-cuda-27b-shape-h200"
