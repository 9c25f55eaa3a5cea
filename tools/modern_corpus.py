"""Modern English prose for the small DiffusionGemma: documentation shipped in Debian packages.

Sources (install with `apt-get install -y --no-install-recommends python3.11-doc debian-reference-en git-doc`):

* `python3.11-doc` 3.11.2: the Python 3.11 documentation, HTML (`/usr/share/doc/python3.11/html`), under the PSF
  License Version 2 (`/usr/share/doc/python3.11-doc/copyright`);
* `git-doc` 2.39.5: the Git manual pages, user manual and guides, HTML (`/usr/share/doc/git/html`), GPL-2;
* `debian-reference-en` 2.100: the Debian Reference by Osamu Aoki, HTML (`/usr/share/debian-reference`),
  GPL-2+ (`/usr/share/doc/debian-reference-en/copyright`).

Each HTML file is one document. Markup is stripped to prose: only the text of `<p>` elements is kept (code blocks,
tables, navigation, headers and footers are dropped), whitespace is collapsed, and a paragraph is kept only if it
has at least 8 words and is mostly letters. Paragraphs are deduplicated over the whole corpus (case-folded,
whitespace-normalised; the first occurrence in the sorted document order wins, and a held-out paragraph that also
occurs in a train document is dropped from the held-out side). Whole documents are held out: the documents are
sorted by (source, path) and every 20th one (index % 20 == 19) is held out.
"""

from __future__ import annotations

import glob
import html.parser
import os
import re

SOURCES = [
    ("python3.11-doc", "/usr/share/doc/python3.11/html", "PSF-2.0"),
    ("git-doc", "/usr/share/doc/git/html", "GPL-2"),
    ("debian-reference-en", "/usr/share/debian-reference", "GPL-2+"),
]
SKIP_CLASSES = {
    "footer",
    "related",
    "sphinxsidebar",
    "sphinxsidebarwrapper",
    "navigation",
    "navheader",
    "navfooter",
    "toc",
    "highlight",
    "admonition-title",
    "copyright",
    "headerlink",
    "header",
    "toctree-wrapper",
    "versionmodified deprecated",
    "mobile-nav",
    "menu-wrapper",
}
SKIP_TAGS = {"pre", "script", "style", "table", "nav", "head", "title", "footer"}
VOID = {"br", "img", "hr", "meta", "link", "input", "area", "base", "col", "embed", "source", "track", "wbr"}


class _Paragraphs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[bool] = []  # per open element: does it start a skipped region?
        self.skip = 0
        self.in_p = 0
        self.buf: list[str] = []
        self.paras: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        cls = dict(attrs).get("class") or ""
        skipping = tag in SKIP_TAGS or any(c in SKIP_CLASSES for c in cls.split()) or cls in SKIP_CLASSES
        self.stack.append((tag, skipping))
        if skipping:
            self.skip += 1
        if tag == "p" and not self.skip:
            self.in_p += 1
            if self.in_p == 1:
                self.buf = []

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        # pop to the matching tag (HTML in the wild is not always balanced)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for t, s in self.stack[i:][::-1]:
                    if s:
                        self.skip -= 1
                    if t == "p" and self.in_p:
                        self.in_p -= 1
                        if self.in_p == 0:
                            self.paras.append("".join(self.buf))
                del self.stack[i:]
                break

    def handle_data(self, data):
        if self.in_p and not self.skip:
            self.buf.append(data)


def clean(p: str) -> str | None:
    p = re.sub(r"\s+", " ", p).strip()
    p = p.replace("\u00b6", "").strip()
    words = p.split()
    if len(words) < 8:
        return None
    letters = sum(c.isalpha() or c == " " for c in p)
    if letters < 0.8 * len(p):
        return None
    if sum(1 for c in p if ord(c) > 127) > 0.05 * len(p):  # mostly non-English pages / symbols
        return None
    return p


def html_paragraphs(path: str) -> list[str]:
    parser = _Paragraphs()
    with open(path, encoding="utf-8", errors="replace") as f:
        parser.feed(f.read())
    return [c for c in (clean(p) for p in parser.paras) if c]


def list_documents() -> list[tuple[str, str]]:
    """[(source package, path)] sorted; English HTML only."""
    docs = []
    for name, root, _ in SOURCES:
        if not os.path.isdir(root):
            raise SystemExit(f"{root} is missing: apt-get install -y --no-install-recommends {name}")
        for path in sorted(glob.glob(os.path.join(root, "**", "*.html"), recursive=True)):
            if name == "debian-reference-en" and not path.endswith(".en.html"):
                continue
            base = os.path.basename(path)
            if (
                "/_static/" in path
                or "/_sources/" in path
                or "/_downloads/" in path
                or base.startswith("genindex")
                or base in ("search.html", "py-modindex.html", "changelog.html")
            ):
                continue
            docs.append((name, path))
    return docs


def build(hold_every: int = 20) -> dict:
    docs = list_documents()
    seen: set[str] = set()
    train, held, train_src, held_src = [], [], [], []
    # First pass: the train documents claim their paragraphs; then the held-out ones get what is left.
    split = [(i % hold_every == hold_every - 1) for i in range(len(docs))]
    parsed = [html_paragraphs(p) for _, p in docs]
    key = lambda s: re.sub(r"\W+", " ", s.lower()).strip()  # noqa: E731
    for is_held in (False, True):
        for (name, path), paras, h in zip(docs, parsed, split, strict=True):
            if h != is_held:
                continue
            keep = []
            for p in paras:
                k = key(p)
                if k in seen:
                    continue
                seen.add(k)
                keep.append(p)
            if not keep:
                continue
            (held if h else train).append("\n".join(keep))
            (held_src if h else train_src).append(
                f"{name}:{os.path.relpath(path, {n: r for n, r, _ in SOURCES}[name])}"
            )
    return {"train_plain": train, "held_plain": held, "train_docs": train_src, "held_docs": held_src}


if __name__ == "__main__":
    c = build()
    for k in ("train", "held"):
        texts = c[f"{k}_plain"]
        print(k, len(texts), "docs", sum(len(t) for t in texts), "chars", sum(len(t.split()) for t in texts), "words")
    print(c["held_docs"][:10])
    print(c["held_plain"][0][:1500])
