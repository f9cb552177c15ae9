"""The docs stay true: docs/config.md is what the config tree generates, every relative link in README.md and docs/*.md
reaches an existing file (and heading), every docs page is reachable from the README, and the README stays a front
page that names the test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmpg.config import reference as config_doc
from mmpg.config import all_keys

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def test_config_reference_is_current():
    written = (DOCS / "config.md").read_text()
    assert written == config_doc.render(), (
        f"docs/config.md is out of date with the config tree (mmpg/config/): regenerate it with `{config_doc.COMMAND}`")


def test_config_reference_lists_every_field():
    page = config_doc.render()
    missing = [key for key in all_keys() if f"| `{key}` |" not in page]
    assert not missing, f"fields without a row in the reference: {missing}"
    assert "| `rollout.n` | int | `8` | Group size G" in page  # key, type, default and help in one row


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks and code spans."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(CODE.sub("", line)):
            found.append((n, target))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def resolve(page: Path, target: str) -> tuple[Path | None, str]:
    """(file, anchor) a relative link points at; file None for an external link."""
    if re.match(r"^[a-z]+:", target):
        return None, ""
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page, anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for n, target in links(page):
        file, anchor = resolve(page, target)
        if file is None:
            continue
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no heading #{anchor} in {file.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Here it is\n")
    page.write_text("[ok](there.md#here-it-is) [gone](missing.md) [bad](there.md#nowhere) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.org)\n")
    results = {t: resolve(page, t) for _, t in links(page)}
    assert list(results) == ["there.md#here-it-is", "missing.md", "there.md#nowhere", "https://example.org"]
    assert not results["missing.md"][0].exists()
    assert "nowhere" not in anchors(tmp_path / "there.md") and "here-it-is" in anchors(tmp_path / "there.md")
    assert results["https://example.org"][0] is None


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [f for f in (resolve(page, t)[0] for _, t in links(page)) if f is not None]
    unreached = [p.name for p in DOCS.glob("*.md") if p.resolve() not in seen]
    assert not unreached, f"docs pages no link from README.md leads to: {unreached}"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme  # .ci/run runs it as the README's test command
    assert len(readme.splitlines()) <= 250, "README.md is the front page: details go to docs/"
