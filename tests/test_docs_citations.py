"""Code cites the project's own docs/, never documents outside the repository or issue numbers.

Whoever picks the project up has the repository and nothing else: a comment saying "spec §7.5", "DESIGN Decision 3",
"kernels.md §9.4" or "issue 20" points at nothing they can open. The design lives in docs/ (architecture.md,
generation.md, seeded-noise.md, exactness.md, kernels.md, ...), and comments cite those files, with a section
title where useful: "(docs/seeded-noise.md, "Gumbel noise")".
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREES = ("python", "service", "csrc", "bench", "scripts", "tools", "tests")
SUFFIXES = {".py", ".pyi", ".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh", ".sh", ".md"}
SELF = pathlib.Path(__file__).resolve()

# A docs/ file named in the code: "docs/kernels.md", "docs/generation.md, "Temperature schedule"".
DOC_REF = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md)\b")

# Citations of documents that are not in the repository (or of issue numbers), each with a short name for messages.
# "§" followed by a number is a numbered section of some document; it is allowed only after a docs/ file on the
# same line (docs/structured-output.md numbers its sections).
FORBIDDEN: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("spec §", re.compile(r"\bspec\s*§")),
    ("spec/ file", re.compile(r"\bspec/[\w.-]+\.md\b")),
    ("DESIGN", re.compile(r"\bDESIGN\b")),
    ("Decision <n>", re.compile(r"\bDecisions? \d+")),
    ("kernels.md outside docs/", re.compile(r"(?<!docs/)\bkernels\.md\b")),
    ("serving.md", re.compile(r"(?<!docs/)\bserving\.md\b")),
    ("style.md", re.compile(r"(?<!docs/)\bstyle\.md\b")),
    ("issue <n>", re.compile(r"\b[Ii]ssues? #?\d+")),
)
SECTION = re.compile(r"§\s*\d")
DOC_BEFORE = re.compile(r"docs/[\w./-]+\.md")


def _source_files() -> list[pathlib.Path]:
    """Text sources under the trees, without caches, generated protobuf stubs, build outputs or this file."""
    out = []
    for tree in TREES:
        base = ROOT / tree
        for p in sorted(base.rglob("*")) if base.exists() else []:
            if p.suffix not in SUFFIXES or not p.is_file() or p.resolve() == SELF:
                continue
            if "__pycache__" in p.parts or "_pb2" in p.name or ".egg-info" in str(p):
                continue
            out.append(p)
    return out


def citations(line: str) -> list[str]:
    """The forbidden citations on one line of source, by name (empty when the line is clean)."""
    found = [name for name, rx in FORBIDDEN if rx.search(line)]
    for m in SECTION.finditer(line):
        if not DOC_BEFORE.search(line[: m.start()]):
            found.append("§ <n> without a docs/ file")
            break
    return found


def test_the_source_trees_are_scanned():
    files = _source_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert "python/dgserve/engine/engine.py" in names and "csrc/common/philox.h" in names, sorted(names)[:20]
    assert len(files) > 100


@pytest.mark.parametrize(
    "line",
    [
        "# spec §7.4 canvas noise",
        '"""Tokenizer (DESIGN.md Decision 9, spec §9)."""',
        "batch invariant: DESIGN Decision 3",
        "(DESIGN Decisions 3)",
        "// design: kernels.md §9.4, swap-AB",
        "see reference/kernels.md",
        "(serving.md §10 rows 1-6)",
        "the layout of style.md",
        "native ops (issue 20, item 1)",
        "(issues 15 and 19)",
        "see Issue #19",
        "the acceptance rule (§4.4)",
        "§10 row 16: a reader that stops reading",
        "the model of spec/diffusiongemma.md",
    ],
)
def test_citation_patterns_catch_outside_references(line):
    assert citations(line), line


@pytest.mark.parametrize(
    "line",
    [
        "# design in docs/kernels.md, 'Grouped expert GEMMs'",
        '(docs/seeded-noise.md, "Gumbel noise")',
        "why: docs/structured-output.md §11.6",
        "the design of the kernel; a design decision",
        "this issue is rare; no issues here",
        "spec = json.loads(text); spec.get('type')",
        "cancelled mid-stream (grpc#43360) leave no growth",
        "DESIGNATED = 3",
        "the expected decision 3 times",
    ],
)
def test_citation_patterns_leave_ordinary_text_alone(line):
    assert not citations(line), line


def test_named_docs_exist():
    """Every docs/<name>.md named in the code is a file of the repository's docs/."""
    missing = []
    for p in _source_files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            absent = [name for name in DOC_REF.findall(line) if not (ROOT / "docs" / name).is_file()]
            missing += [f"{p.relative_to(ROOT)}:{i}: docs/{name}" for name in absent]
    assert not missing, "docs named in the code but absent:\n" + "\n".join(missing)


def test_no_citations_outside_the_repository():
    """No comment, docstring or string under the source trees cites spec/, DESIGN, reference notes or issue numbers;
    cite the file in docs/ that explains the point instead."""
    bad = []
    for p in _source_files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            found = citations(line)
            if found:
                bad.append(f"{p.relative_to(ROOT)}:{i}: {', '.join(found)}: {line.strip()[:100]}")
    assert not bad, f"{len(bad)} lines cite documents outside the repository (cite docs/ instead):\n" + "\n".join(bad)


# A section cited after its file: docs/images.md, "Admission" in code; [images.md](images.md), "Admission" in docs.
SECTION_REF = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md),\s*\\?\"([^\"\\]+)\\?\"")
LINK_SECTION_REF = re.compile(r"\]\(([\w./-]+?\.md)\),\s*\"([^\"]+)\"")


def _headings(doc: pathlib.Path) -> set[str]:
    """What a section citation may name in a markdown file: a heading's title (also without its leading number,
    "11.5 Bounds", or its subtitle, "Limits: what one request can cost"), a bold paragraph lead ("**Bounded like
    text**") or a list item's label ("- Failures: ..."); backticks dropped."""
    out: set[str] = set()
    for line in doc.read_text(errors="replace").replace("`", "").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            out |= {title, re.sub(r"^[\d.]+\s+", "", title), title.split(":")[0]}
        out |= {m.strip().rstrip(":.") for m in re.findall(r"\*\*([^*]+)\*\*", line)}
        label = re.match(r"\s*[-*] ([^:*]{1,60}):", line)
        if label:
            out.add(label.group(1).strip())
    return out


def _cited_sections() -> list[tuple[str, str, str]]:
    """(where, doc name, section) for every section cited with its file, in the code trees, README.md and docs/."""
    out = []
    docs = sorted((ROOT / "docs").glob("*.md"))
    for p in [*_source_files(), ROOT / "README.md", *docs]:
        text = p.read_text(errors="replace")
        for rx in (SECTION_REF, LINK_SECTION_REF):
            for m in rx.finditer(text):
                where = f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                section = " ".join(re.sub(r"\n\s*(#|//|\*)?", " ", m.group(2)).split())  # a title cut by a wrap
                out.append((where, pathlib.PurePosixPath(m.group(1)).name, section))
    return out


def test_cited_sections_exist():
    """Every section cited by its title next to its docs file ("docs/images.md, "Admission"") is a heading, a bold
    paragraph lead or a list label of that file: a renamed or removed section fails here, not in a reader's
    hands."""
    assert len(_cited_sections()) > 50  # the patterns find the citations
    missing = [
        f"{where}: {doc}, {section!r}"
        for where, doc, section in _cited_sections()
        if (ROOT / "docs" / doc).is_file() and section.replace("`", "") not in _headings(ROOT / "docs" / doc)
    ]
    assert not missing, "sections cited but not headings of their file:\n" + "\n".join(missing)
