"""The data pages' `mmpg check-data` examples, run as printed on the public annotation files (`../shared/data/real/`,
skipped when absent) placed at the documented paths, the videos absent: each exits 1 and prints every line its page
shows as its output before the videos are in place (what it prints after: tests/test_data_docs.py). And the pages state the loaders' rule for ends past the video as the code has it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from train_utils import _warm_process
from train_utils import env as cli_env

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / ".." / "shared" / "data" / "real"  # ../shared from the repository root
PAGES = sorted((ROOT / "data").glob("*.md")) + [ROOT / "docs" / "data.md"]
# documented annotation path -> (the file standing in for it, how it is placed)
STANDINS = {
    "data/charades/charades_sta_test.txt": (REAL / "charades_test.json", "tall"),  # the TALL text, from the JSON copy
    "data/charades/charades_train.json": (REAL / "charades_train.json", "link"),
    "data/activitynet/val_2.json": (REAL / "anet_val2.json", "link"),
    "data/timer1/annotations/train_2k5.json": (REAL / "train_2k5.json", "link"),
    "data/timer1/annotations/tvgbench.json": (REAL / "tvgbench.json", "link"),
    "data/timelens/charades-timelens.json": (ROOT / "tests" / "fixtures" / "timelens" / "charades-timelens.json",
                                             "link"),  # format only: its page shows no output
}
PLACEHOLDERS = {"ANN": "data/charades/charades_sta_test.txt", "DIR": "data/charades/Charades_v1_480"}


def _examples() -> list[tuple[Path, list[str], list[list[str]]]]:
    """(page, its check-data commands, its output blocks) for each page with a check-data command."""
    found = []
    for page in PAGES:
        text = page.read_text()
        commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                    for line in block.splitlines() if line.startswith("mmpg check-data")]
        outputs = [block.splitlines() for block in re.findall(r"```text\n(.*?)```", text, flags=re.S)]
        if commands:
            found.append((page, commands, outputs))
    return found


def _place(world: Path, documented: str) -> None:
    source, how = STANDINS[documented]
    target = world / documented
    target.parent.mkdir(parents=True, exist_ok=True)
    if how == "link":
        target.symlink_to(source.resolve())
        return
    with target.open("w") as f:  # Charades-STA's text form: `VIDEO START END##sentence`, in the JSON's order
        for video, entry in json.loads(source.read_text()).items():
            for (start, end), sentence in zip(entry["timestamps"], entry["sentences"]):
                f.write(f"{video} {start} {end}##{sentence}\n")


def test_the_pages_state_the_loaders_rule_for_ends_past_the_video():
    from mmpg.data.samples import end_margin

    assert (end_margin(10.0), end_margin(30.0), end_margin(157.791)) == pytest.approx((2.0, 3.0, 15.7791))
    for page in (ROOT / "data" / "README.md", ROOT / "data" / "charades_sta.md"):
        assert "max(2 s, 10 % of the duration)" in page.read_text(), page.name
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\b0\.5 s\b.{0,40}clamp|clamp.{0,40}\b0\.5 s\b", text, flags=re.S), page.name


def test_one_folder_name_per_dataset():
    """Every video folder the docs pass for Charades-STA is the same one."""
    texts = [p.read_text() for p in [*PAGES, ROOT / "README.md", *(ROOT / "docs").glob("*.md")]]
    named = {m for t in texts for m in re.findall(r"data/charades/(Charades_v1\w*)", t)}
    assert named == {"Charades_v1_480"}, named


@pytest.mark.skipif(not (REAL / "tvgbench.json").is_file(), reason="the public annotation files are absent")
def test_each_check_data_example_says_what_its_page_shows(tmp_path):
    world = tmp_path
    examples = _examples()
    assert {p.name for p, _, _ in examples} >= {"charades_sta.md", "activitynet_captions.md", "time_r1.md",
                                               "timelens.md", "README.md", "data.md"}
    shown_blocks = 0
    for page, commands, outputs in examples:
        printed = {}
        for command in commands:
            words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)]
            annotations, videos = words[words.index("--annotations") + 1], words[words.index("--videos") + 1]
            assert annotations in STANDINS, f"{page.name}: add a stand-in for {annotations}"
            if not (world / annotations).exists():
                _place(world, annotations)
            (world / videos).mkdir(parents=True, exist_ok=True)
            proc = _warm_process().run(words[1:], cli_env(), world, 300)
            assert proc.returncode == 1, (page.name, command, proc.stdout[-2000:], proc.stderr[-2000:])
            assert "video file not found" in proc.stdout
            printed[annotations] = proc.stdout.splitlines()
        for block in outputs:
            if not any(line.startswith("missing videos: ") for line in block):
                continue  # shown for the videos in place: tests/test_data_docs.py runs those
            owners = [a for a in printed if any(a in line for line in block)]
            assert len(owners) == 1, f"{page.name}: which command's output is this block? {block[:3]}"
            for line in block:
                if line != "...":
                    assert line in printed[owners[0]], f"{page.name}: check-data did not print {line!r}"
            shown_blocks += 1
    assert shown_blocks == 4
