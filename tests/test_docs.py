"""The user docs describe what the code does now: README.md and the manual's pages (docs/, all but
the benchmarks archive, which keeps the runs as they were recorded) carry no issue numbers, work
logs or status notes, and the README stays a front door (the manual is docs/)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 260
ARCHIVE = REPO / "docs" / "benchmarks-archive.md"

# What a work log or status note looks like. "SSH session" (a dropped terminal) is a user's word, not
# a work log, so only the phrases a diary uses are refused.
FORBIDDEN = [
    # "issue 24", "issue #24", "issues #3"; not the verb ("the step issues 73 collectives").
    (re.compile(r"\bissue\s*#?\d+|\bissues\s*#\d+", re.I), "an issue number"),
    # "#48", not an anchor id ({#2-d-...}) or a URL fragment.
    (re.compile(r"(?<![\w/.{-])#\d{1,5}\b"), "an issue reference (#N)"),
    (re.compile(r"\bin progress\b", re.I), "an 'in progress' note"),
    (re.compile(r"\bstays? open\b", re.I), "a status note"),
    (re.compile(r"\b(this|previous|last|next|that) session\b|\bsession notes?\b", re.I), "a session note"),
    (re.compile(r"\b(TODO|FIXME|XXX)\b"), "a to-do note"),
]


def user_docs() -> list[Path]:
    pages = sorted(p for p in (REPO / "docs").rglob("*.md") if p != ARCHIVE)
    return [REPO / "README.md", *pages]


def offences(text: str) -> list[str]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, what in FORBIDDEN:
            m = pattern.search(line)
            if m:
                found.append(f"line {lineno}: {what}: {m.group(0)!r}")
    return found


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_carry_no_issue_numbers_or_status_notes(page):
    assert offences(page.read_text()) == [], \
        f"{page.relative_to(REPO)}: user docs say what the code does now (move run diaries to {ARCHIVE.name})"


@pytest.mark.parametrize("text", ["Fixed in issue 24.", "2-D tensor parallelism (issue 23)", "see #48",
                                  "(issue 24, in progress)", "so issue 21 stays open",
                                  "the previous session measured", "TODO: measure"])
def test_the_check_catches_what_it_refuses(text):
    assert offences(text), text


def test_the_check_lets_ordinary_prose_through():
    ok = ("a dropped SSH session stops the job; the inference session loads the model; `tiny`'s step issues 73 collectives; "
          "see [benchmarks](benchmarks.md#2-d-tensor-parallelism); color #fff is not an issue")
    assert offences(ok) == []


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    text = "\n".join(lines)
    for must in ("make run", "make test", "docs/architecture.md", "docs/benchmarks.md"):
        assert must in text, must


def test_every_page_is_in_the_site_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs").rglob("*.md"):
        assert str(page.relative_to(REPO / "docs")) in nav, f"{page.name} is not in mkdocs.yml's nav"
