"""The commands README.md and the pages under docs/ and data/ tell a user to run, collected the same way for every
test that runs or checks them (tests/test_documented_commands.py holds that each one is covered).

A command is a line of a ```bash block (joined with its `\\` continuations, the trailing `# comment` cut), or the
inline `code` of the prose when it starts like a command (`mmpg ...`, `bash scripts/...`, `python -m mmpg...`, an
`ENV=value` prefix before one of those). Usage forms (`[--quick | --long]`, `...`) are kept as written; the tests
expand them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "data").glob("*.md"))]
# inline code that is a command, not a name or a value
_INLINE = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S+ )*(?:mmpg [a-z]|bash scripts/|python -m mmpg|torchrun |deepspeed )")


@dataclass(frozen=True)
class Command:
    where: str  # page:line, relative to the project root
    text: str  # the command, continuations joined, comment cut
    inline: bool  # from the prose's `code`, not from a shell block


def _cut_comment(line: str) -> str:
    """The line without a trailing ` # comment` outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] == " "):
            return line[:i].rstrip()
    return line.rstrip()


def _page(path: Path) -> list[Command]:
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    found, fence, n = [], None, 0
    while n < len(lines):
        line = lines[n]
        start = n + 1
        opening = re.match(r"^\s*```(\S*)", line)
        if opening:
            fence = None if fence is not None else opening.group(1)
        elif fence == "bash":
            text = _cut_comment(line)
            while text.endswith("\\") and n + 1 < len(lines):
                n += 1
                text = text[:-1].rstrip() + " " + _cut_comment(lines[n]).strip()
            if text.strip():
                found.append(Command(f"{name}:{start}", text.strip(), False))
        elif fence is None:
            found += [Command(f"{name}:{start}", span.strip(), True) for span in re.findall(r"`([^`\n]+)`", line)
                      if _INLINE.match(span.strip())]
        n += 1
    return found


def documented_commands(pages=None) -> list[Command]:
    return [c for page in (pages or PAGES) for c in _page(page)]


def words_after_env(text: str) -> tuple[dict, list[str]]:
    """({VAR: value} of the leading assignments, the words after them) of a command (shell quoting honoured)."""
    import shlex

    words = shlex.split(text)
    env = {}
    while words and re.match(r"^[A-Z][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words
