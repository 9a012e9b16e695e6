"""The docs hold together: every relative link in README.md, docs/**/*.md and bench/README.md reaches a file that
exists, and a `#anchor` into a markdown file names one of its headings (GitHub's slugs); the README stays a guide
of at most 300 lines. No training, no kit import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

# Pages being written beside a change; a link to one passes while the file is missing. Drop an entry once it is in.
EXPECTED_SOON: set[str] = set()

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (a link written as code is not one)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else INLINE_CODE.sub("", line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose_lines(text), start=1):
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        definition = REFERENCE_DEF.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: link and image markup reduced to its text, lower case, every character but
    letters, digits, `_`, `-` and spaces dropped (backticks, colons, dots, parentheses...), spaces made `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in a markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: Path, root: Path = ROOT, expected_soon: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """One line per link of `path` that does not resolve: a missing file, or an anchor no heading of it has."""
    problems = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if SCHEME.match(target):  # https:, mailto: ...: not a file of this repository
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.exists():
            inside = resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else None
            if inside not in expected_soon:
                problems.append(f"{where}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with the anchor #{anchor} in {resolved.relative_to(root)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    problems = broken_links(path, expected_soon=EXPECTED_SOON)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_checked_include_the_readme_and_the_moved_pages():
    checked = {p.relative_to(ROOT).as_posix() for p in doc_files()}
    assert {"README.md", "bench/README.md", "docs/results.md", "docs/testing.md", "docs/check.md",
            "docs/recipes/tiny-tools.md"} <= checked


def test_readme_is_a_guide_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it a user guide and move reference material or results to docs/")


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    heading = "## Run `kit check`: before a GPU run\n\n"
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n" + heading + heading)
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/guide.md) [ok](docs/guide.md#run-kit-check-before-a-gpu-run)"
        " [ok, repeated heading](docs/guide.md#run-kit-check-before-a-gpu-run-1) [web](https://example.com/x.md)\n"
        "[self](#top) [gone](docs/gone.md) [bad anchor](docs/guide.md#no-such-heading)\n"
        "# Top\n\n`[code](docs/not-a-link.md)`\n\n```\n[fenced](docs/not-a-link-either.md)\n```\n"
        "[soon](docs/soon.md)\n")
    assert broken_links(readme, root=tmp_path, expected_soon={"docs/soon.md"}) == [
        "README.md:2: docs/gone.md: no such file",
        "README.md:2: docs/guide.md#no-such-heading: no heading with the anchor #no-such-heading in docs/guide.md",
    ]
    assert broken_links(readme, root=tmp_path)[-1] == "README.md:10: docs/soon.md: no such file"


def test_github_slugs():
    assert github_slug("Checking a recipe before training: `kit check`, and difficulty filtering") == (
        "checking-a-recipe-before-training-kit-check-and-difficulty-filtering")
    assert github_slug("The reward signal (`kit check --signal`)") == "the-reward-signal-kit-check---signal"
    assert github_slug("Difficulty filtering (RL stages)") == "difficulty-filtering-rl-stages"
    assert github_slug("A real model, offline: `model: smollm2-135m`") == "a-real-model-offline-model-smollm2-135m"
