"""The documentation holds together: every relative link in README.md and docs/*.md points to a
file that exists and, where it names an anchor (`page.md#section`), to a heading of that page,
spelled as GitHub spells heading anchors. Links inside code (fenced blocks, `inline`) are not
links; web addresses (http://, https://, mailto:) are not checked. The README stays a newcomer's
page: under 200 lines, with the two commands a newcomer pastes."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, in_fence = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (letters,
    digits, `_`, `-` and spaces kept), each space a `-`."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(page):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_anchor(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [
        target
        for line in prose_lines(page)
        for target in LINK.findall(INLINE_CODE.sub("", line))
        if not target.startswith(EXTERNAL)
    ]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    report = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in PAGES}
    assert {page: links for page, links in report.items() if links} == {}


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []


def test_the_readme_is_a_newcomers_page_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert 'pip install -e ".[dev]" && ./run_train.sh --config train_configs/vlm_cp.toml' in text
    assert 'pip install -e ".[dev]" && python -m pytest' in text


def test_github_anchors_are_spelled_as_github_spells_them() -> None:
    assert github_anchor("Where the ViT runs: `cp_vision`") == "where-the-vit-runs-cp_vision"
    assert (
        github_anchor("Packed rows: balance of the CP split, `python -m pytest -s x/y.py`")
        == "packed-rows-balance-of-the-cp-split-python--m-pytest--s-xypy"
    )
    assert github_anchor("2. Launch: the same command on every node") == (
        "2-launch-the-same-command-on-every-node"
    )
