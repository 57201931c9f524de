"""The docs live in the repository: every reference to a doc names a file the clone contains
(and, for docs/design.md, a section that exists), and every relative Markdown link resolves."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split() if (ROOT / p).exists()]


def design_sections() -> set[str]:
    """"2", "4.3", ... of the numbered headings of docs/design.md."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", (ROOT / "docs" / "design.md").read_text(), re.M))


def test_references_to_docs_name_files_and_sections_that_exist():
    sections, checked = design_sections(), 0
    assert {"1", "2", "3", "4", "4.1", "4.2", "4.3", "4.4", "4.5", "5", "6", "7", "8"} <= sections
    for path in tracked("*.py", "*.cfg", "*.toml", "*.sh", "Makefile"):
        text = path.read_text()
        for ref in re.findall(r"docs/[\w./-]+\.md", text):
            assert (ROOT / ref).exists(), f"{path.relative_to(ROOT)} cites {ref}, which the repository lacks"
            checked += 1
        # "docs/design.md section 3", "docs/design.md 4.3", "sections 2, 3 and 4.3", "4.2-4.3"
        for cited in re.findall(r"docs/design\.md,? (?:sections? )?([\d., and-]*\d)", text):
            for number in re.findall(r"\d+(?:\.\d+)?", cited):
                assert number in sections, (f"{path.relative_to(ROOT)} cites docs/design.md {number}, "
                                            "which has no such section")
        outside = re.search(r"\bDESIGN\.md|\.\./shared/", text)  # the project's folder beside the clone
        assert outside is None or path.name == "test_docs.py", f"{path.relative_to(ROOT)} points outside the repository"
    assert checked > 20


def test_relative_markdown_links_resolve():
    checked = 0
    for page in tracked("*.md"):
        if "bench/results" in str(page) and page.name != "README.md":
            continue  # recorded results quote the commands and paths of their day
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
            checked += 1
    assert checked > 20


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 180
    for command in ("make demo", "make test"):
        assert command in readme
