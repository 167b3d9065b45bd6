"""The user docs' links resolve, and every figure of docs/PERFORMANCE.md §1 (Recommendations) links its raw record
under docs/gpu_results/ and says how it was taken (warm, a mean over all steps, or cold with its cache state)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "gpu_results" / "INDEX.md"]
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
    """(line number, cells) of every body row of the tables in PERFORMANCE.md §1."""
    lines = (ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()
    start = lines.index("## 1. Recommendations")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    rows, header = [], None
    for i in range(start, end):
        line = lines[i]
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif not set(line) <= set("|- "):
            assert len(cells) == len(header), f"PERFORMANCE.md:{i + 1}: {len(cells)} cells, header has {len(header)}"
            rows.append((i + 1, dict(zip(header, cells))))
    return rows


def test_every_recommendation_links_its_raw_record_and_says_warm_or_cold():
    rows = _recommendation_rows()
    assert len(rows) > 40  # the three tables: one H200, one H100, several H200s
    bad = []
    for ln, row in rows:
        gain = next(v for k, v in row.items() if k.startswith("gain"))
        if not any(t in gain for t in ("warm", "mean of", "cold")):
            bad.append(f"PERFORMANCE.md:{ln}: the gain cell says neither warm, 'mean of N steps' nor cold")
        if re.search(r"\bfirst (step|call)\b|end to end|\bwarm-up call\b", gain) and not re.search(
                r"cache state not recorded|empty caches|warm compile caches|cache not empty", gain):
            bad.append(f"PERFORMANCE.md:{ln}: a first-use figure without the compile caches' state")
        if not any("gpu_results/" in t for t in LINK.findall(row["figure"])):
            bad.append(f"PERFORMANCE.md:{ln}: the figure cell links no raw record under gpu_results/")
    assert not bad, "\n".join(bad)
