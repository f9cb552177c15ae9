"""The README, docs, scripts, code and tests speak of the project and its users: no word of the machines or tools the
project was built with. The check greps the tracked files of README.md, docs, scripts, mmpg, app and tests
(case-insensitive, whole words, as `grep -rniwE` does) for WORDS, which are spelled here in pieces so that this file
passes its own check."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHERE = ("README.md", "docs", "scripts", "mmpg", "app", "tests")
# grep -w: not preceded or followed by a word character (letters, digits, underscore)
WORDS = ("le" "nt", "device" " time", r"KIN" r"DS\.md", "car" "ry=")
PATTERN = re.compile(r"(?<!\w)(" + "|".join(WORDS) + r")(?!\w)", re.IGNORECASE)


def hits(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary or gone
        for n, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:160]}")
    return out


def test_the_pattern_finds_what_grep_finds(tmp_path):
    sample = tmp_path / "x.txt"
    word, phrase, doc, flag = ("Le" "nt", "device" " time", "KIN" "DS.md", "car" "ry=")
    sample.write_text(f"on the {word} machine\nexcel{word.lower()} si{word.lower()}\n{flag}['wheels']\n{phrase} left\n"
                      f"{doc}\n{flag}wheels\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert [h.split(":")[1] for h in hits([sample])] == ["1", "3", "4", "5"]
    finally:
        ROOT = old


def test_no_word_of_the_build_machines_in_tracked_files():
    listed = subprocess.run(["git", "ls-files", "-z", "--", *WHERE], cwd=ROOT, capture_output=True, check=True)
    files = [ROOT / p for p in listed.stdout.decode().split("\0") if p]
    assert len(files) > 100  # the walk saw the tree
    found = hits(files)
    assert not found, "say it for any GPU machine and its user instead:\n" + "\n".join(found)
