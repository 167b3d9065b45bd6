"""The docs' links resolve; every recommendation links its raw record under docs/gpu_results/ and says how it was
taken (warm, a mean over all steps, or cold with its cache state); the README answers in one screen; no user page
is longer than about 800 lines or tells the history of the work; docs/gpu_results/ holds records, not lock files or
copies of scripts."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the pages a user reads (README and docs/*.md), and every page of the docs (the measurement notes included)
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = USER_PAGES + sorted(p for p in (ROOT / "docs").rglob("*.md") if p.parent != ROOT / "docs")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """The heading anchors a Markdown renderer makes (GitHub's rule: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading suffixed -1, -2, ...)."""
    out, seen = set(), {}
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(doc: Path):
    """(line number, target) of each relative link outside code blocks."""
    fenced = False
    for ln, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced:
            yield from ((ln, t) for t in LINK.findall(line) if not re.match(r"[a-z]+:", t))


def test_every_relative_link_in_the_docs_resolves():
    bad = []
    for doc in DOCS:
        for ln, target in _links(doc):
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}:{ln}: {target}: no such file or folder")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                bad.append(f"{doc.relative_to(ROOT)}:{ln}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def _recommendation_rows():
    """(line number, cells) of every body row of the tables in RECOMMENDATIONS.md."""
    lines = (ROOT / "docs" / "RECOMMENDATIONS.md").read_text().splitlines()
    rows, header = [], None
    for i in range(len(lines)):
        line = lines[i]
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif not set(line) <= set("|- "):
            assert len(cells) == len(header), f"RECOMMENDATIONS.md:{i + 1}: {len(cells)} cells, header has {len(header)}"
            rows.append((i + 1, dict(zip(header, cells))))
    return rows


def test_every_recommendation_links_its_raw_record_and_says_warm_or_cold():
    rows = _recommendation_rows()
    assert len(rows) > 40  # the three tables: one H200, one H100, several H200s
    bad = []
    for ln, row in rows:
        gain = next(v for k, v in row.items() if k.startswith("gain"))
        if not any(t in gain for t in ("warm", "mean of", "cold")):
            bad.append(f"RECOMMENDATIONS.md:{ln}: the gain cell says neither warm, 'mean of N steps' nor cold")
        if re.search(r"\bfirst (step|call)\b|end to end|\bwarm-up call\b", gain) and not re.search(
                r"cache state not recorded|empty caches|warm compile caches|cache not empty", gain):
            bad.append(f"RECOMMENDATIONS.md:{ln}: a first-use figure without the compile caches' state")
        if not any("gpu_results/" in t for t in LINK.findall(row["figure"])):
            bad.append(f"RECOMMENDATIONS.md:{ln}: the figure cell links no raw record under gpu_results/")
    assert not bad, "\n".join(bad)


def test_the_readme_answers_in_one_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, f"README.md: {len(lines)} lines"
    first = "\n".join(lines[:40])
    for target in ("make setup", "make demo", "make test"):
        assert target in first, f"README.md: `{target}` is not in its first 40 lines"
    assert "<!-- table:pick -->" in "\n".join(lines), "README.md: no what-to-pick table"


def test_no_page_of_the_docs_is_much_longer_than_800_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in DOCS if (n := len(p.read_text().splitlines())) > 820]
    assert not long, "\n".join(long)


#: words that tell the history of the work rather than what the tool does (the notes beside the records may)
HISTORY = re.compile(r"\b(today|today's|earlier|session|no longer|lent)\b|\b(code|commit) [0-9a-f]{7,40}\b", re.I)


def test_the_user_pages_tell_no_history():
    bad = []
    for page in USER_PAGES:
        for ln, line in enumerate(page.read_text().splitlines(), 1):
            m = HISTORY.search(re.sub(r"\]\([^)]*\)", "]", line))
            if m:
                bad.append(f"{page.relative_to(ROOT)}:{ln}: {m.group(0)!r}")
    assert not bad, "\n".join(bad)


def _results_files():
    """The files under docs/gpu_results: git's list in a checkout (what would be committed), else the folder's."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "docs/gpu_results"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return [p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "gpu_results").rglob("*") if p.is_file()]


def test_the_results_hold_records_not_lock_files_or_script_copies():
    bad = [f for f in _results_files() if f.endswith((".lock", ".py", ".sh"))]
    assert not bad, "kept beside the records (the command that reproduces them goes in INDEX.md or a README):\n" + \
        "\n".join(bad)
