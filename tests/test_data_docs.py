"""The data docs (data/*.md, docs/data.md, docs/evaluation.md's counts) say what the code does, so they cannot drift:

- every count they state for a public file is what mmpg's loader gives on that file (`../shared/data/real/`, the
  copies the docs pin by commit and SHA-256; skipped when absent), and no number in them sits a few queries off one
  (the "12,401" of an older page, where the loader keeps 12,404);
- the `check-data` output they show once the videos are in place is what `check-data` prints on those files with
  every video present and lasting what the file states (the videos-absent output is tests/test_data_commands.py's);
- the clamp rule they state is the code's constants (`max(2 s, 10 %)`, not a 0.5 s of older pages);
- each dataset has one folder, used the same in the docs, configs, scripts, tests, mmpg and .gitignore.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / ".." / "shared" / "data" / "real"  # ../shared from the repository root
PAGES = [*sorted((ROOT / "data").glob("*.md")), ROOT / "docs" / "data.md", ROOT / "docs" / "evaluation.md"]
# the file a page names -> the public copy it stands for
COPIES = {"data/charades/charades_test.json": "charades_test.json",
          "data/charades/charades_train.json": "charades_train.json",
          "data/activitynet/val_2.json": "anet_val2.json",
          "data/timer1/annotations/train_2k5.json": "train_2k5.json",
          "data/timer1/annotations/tvgbench.json": "tvgbench.json"}
# docs/evaluation.md's row names
ROWS = {"Charades-STA test": "data/charades/charades_test.json",
        "Charades-STA train": "data/charades/charades_train.json",
        "ActivityNet Captions val_2": "data/activitynet/val_2.json",
        "TimeRFT (`train_2k5.json`)": "data/timer1/annotations/train_2k5.json",
        "TVGBench": "data/timer1/annotations/tvgbench.json"}
# each dataset's one folder and the names the docs may use inside it ("/"-joined paths below the folder)
LAYOUT = {
    "charades": {"charades_sta_train.txt", "charades_sta_test.txt", "charades_train.json", "charades_test.json",
                 "Charades_v1_480"},
    "activitynet": {"train.json", "val_1.json", "val_2.json", "videos"},
    "timer1": {"annotations", "annotations/train_2k5.json", "annotations/tvgbench.json", "videos",
               "videos/timerft_data", "videos/tvgbench_data"},
    "timelens": {"charades-timelens.json", "activitynet-timelens.json", "qvhighlights-timelens.json", "videos",
                 "videos/charades", "videos/activitynet", "videos/qvhighlights", "video_shards"},
}
DATASET_LIKE = re.compile(r"charad|activit|anet|time.?r|tvg|timelens|qvh|densevid", re.I)
have_real = pytest.mark.skipif(not (REAL / "tvgbench.json").is_file(), reason="the public annotation files are absent")


def _text(page: Path) -> str:
    return re.sub(r"\s+", " ", page.read_text())


def _int(word: str) -> int:
    return int(word.replace(",", ""))


@lru_cache(maxsize=None)
def facts(documented: str) -> dict:
    """What the loader gives on the public copy a documented file stands for."""
    from mmpg.data.formats import load_annotations

    path = REAL / COPIES[documented]
    train = load_annotations(path, strict=False, log_skips=False)
    papers = load_annotations(path, strict=False, log_skips=False, keep_all=True)
    clamped = [s.raw_span[1] - s.duration for s in train.samples if s.raw_span is not None]
    reasons = Counter("start >= end" if ">= end" in s.reason else "end past the margin" if "allowed: max(" in s.reason
                      else s.reason for s in train.skipped)
    return {"queries": len(train.samples) + len(train.skipped), "videos": len({s.video for s in papers.samples}),
            "used": len(train.samples), "skipped": len(train.skipped), "reasons": reasons,
            "clamped": len(clamped), "clamped_max": round(max(clamped), 2) if clamped else 0.0,
            "papers": len(papers.samples), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "raw_queries": [s.raw_query for s in papers.samples if s.raw_query is not None], "samples": papers}


def _table(page: Path, first_header: str) -> list[list[str]]:
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@have_real
def test_the_counts_table_is_the_loaders():
    rows = {row[0].strip("`"): row for row in _table(ROOT / "data" / "README.md", "file")}
    assert set(rows) == set(COPIES), "data/README.md's counts table names each public copy once"
    for documented, (_, queries, videos, used, skipped, clamped, papers) in rows.items():
        f = facts(documented)
        m = re.match(r"([\d,]+) \(up to ([\d.]+) s\)", clamped)
        stated = (_int(queries), _int(videos), _int(used), _int(skipped.split()[0]), _int(m[1]), float(m[2]),
                  _int(papers))
        assert stated == (f["queries"], f["videos"], f["used"], f["skipped"], f["clamped"], f["clamped_max"],
                          f["papers"]), documented
        for reason, n in f["reasons"].items():  # every reason the loader gives is named, with its count if several
            assert reason in skipped and (len(f["reasons"]) == 1 or f"{n} {reason}" in skipped), (documented, reason)


@have_real
def test_the_checksums_are_the_counted_files():
    rows = _table(ROOT / "data" / "README.md", "file here")
    assert {r[0].strip("`") for r in rows} == set(COPIES)
    for documented, source, digest in rows:
        assert facts(documented.strip("`"))["sha256"].startswith(digest.strip("`")), documented
        assert source.split()[0] in ("OpenGVLab/VideoChat-R1", "xiaomi-research/time-r1")


@have_real
def test_evaluation_counts_table_is_the_loaders():
    rows = {row[0]: row for row in _table(ROOT / "docs" / "evaluation.md", "file")}
    assert set(rows) == set(ROWS)
    for name, (_, queries, used, papers) in rows.items():
        f = facts(ROWS[name])
        assert (_int(queries), _int(used.split()[0]), _int(papers)) == (f["queries"], f["used"], f["papers"]), name


def _whitespace(documented: str, where: str) -> int:
    """Queries of the file that start with whitespace ("start") or start or end with it ("either")."""
    raw = facts(documented)["raw_queries"]  # the file's text where the loader changed it
    return sum(q[:1].isspace() if where == "start" else q != q.strip() for q in raw)


def _as_written(documented: str) -> list:
    """The file's spans, unclamped (`validate=False`)."""
    from mmpg.data.formats import load_annotations

    return load_annotations(REAL / COPIES[documented], strict=False, validate=False, log_skips=False).samples


def _shared_names(documented: str) -> tuple[int, int, int]:
    """(file names given different durations, files, records naming those)."""
    by_name = defaultdict(set)
    records = Counter()
    for s in facts(documented)["samples"].samples:
        by_name[s.video].add(s.duration)
        records[s.video] += 1
    split = [v for v, d in by_name.items() if len(d) > 1]
    return len(split), len(by_name), sum(records[v] for v in split)


TEST, TRAIN, ANET, RFT, TVG = COPIES
# (page, a claim with its figures as groups, the loader's figures)
CLAIMS = [
    ("data/charades_sta.md", r"([\d,]+) training and ([\d,]+) test queries over ([\d,]+) and ([\d,]+) videos",
     lambda: (facts(TRAIN)["queries"], facts(TEST)["queries"], facts(TRAIN)["videos"], facts(TEST)["videos"])),
    ("data/charades_sta.md", r"training uses ([\d,]+) of the ([\d,]+) queries",
     lambda: (facts(TRAIN)["used"], facts(TRAIN)["queries"])),
    ("data/charades_sta.md", r"all ([\d,]+) of its queries are used", lambda: (facts(TEST)["used"],)),
    ("data/charades_sta.md", r"([\d,]+) of the ([\d,]+) test queries end up to ([\d.]+) s",
     lambda: (facts(TEST)["clamped"], facts(TEST)["queries"], facts(TEST)["clamped_max"])),
    ("data/activitynet_captions.md", r"all ([\d,]+) queries are used", lambda: (facts(ANET)["used"],)),
    ("data/activitynet_captions.md", r"Leading whitespace in sentences \(([\d,]+) of val_2's ([\d,]+)\)",
     lambda: (_whitespace(ANET, "start"), facts(ANET)["queries"])),
    ("data/time_r1.md", r"training uses ([\d,]+) of TimeRFT's ([\d,]+) queries and ([\d,]+) of TVGBench's ([\d,]+)",
     lambda: (facts(RFT)["used"], facts(RFT)["queries"], facts(TVG)["used"], facts(TVG)["queries"])),
    ("data/time_r1.md", r"([\d,]+) of its ([\d,]+) file names are given by records that state different durations "
     r"\(([\d,]+) records", lambda: _shared_names(TVG)),
    ("data/README.md", r"most of ActivityNet Captions val_2's sentences start with whitespace \(([\d,]+) of ([\d,]+)",
     lambda: (_whitespace(ANET, "start"), facts(ANET)["queries"])),
    ("data/README.md", r"Charades-STA ends every query with a period \(([\d,]+) of ([\d,]+) test queries\)",
     lambda: (sum(s.query.endswith(".") for s in facts(TEST)["samples"].samples), facts(TEST)["queries"])),
    ("data/README.md", r"([\d,]+) of TVGBench's ([\d,]+) questions begin or end with whitespace",
     lambda: (_whitespace(TVG, "either"), facts(TVG)["queries"])),
    ("data/README.md", r"TimeRFT also has ([\d,]+) ends past the duration by float rounding only",
     lambda: (sum(0 < s.span[1] - s.duration <= 1e-6 for s in _as_written(RFT)),)),
    ("data/README.md", r"the same queries as the JSON copies \(([\d,]+) and ([\d,]+)\)",
     lambda: (facts(TRAIN)["queries"], facts(TEST)["queries"])),
    ("docs/evaluation.md", r"TVGBench \| [\d,]+ \| [\d,]+ \((\d+) zero-length, (\d+) end ([\d.]+) s past",
     lambda: (facts(TVG)["reasons"]["start >= end"], facts(TVG)["reasons"]["end past the margin"], 4.85)),
]


@have_real
@pytest.mark.parametrize("page, claim, truth", CLAIMS, ids=[f"{c[0]}:{c[1][:30]}" for c in CLAIMS])
def test_each_stated_figure_is_the_loaders(page, claim, truth):
    found = re.search(claim, _text(ROOT / page))
    assert found, f"{page} no longer says {claim!r}: update the claim here with the page"
    stated = tuple(float(g) if "." in g else _int(g) for g in found.groups())
    assert stated == tuple(truth()), f"{page}: {found[0]!r}, the loader gives {truth()}"


def _known_counts() -> set[int]:
    out = set()
    for documented in COPIES:
        f = facts(documented)
        out |= {f["queries"], f["videos"], f["used"], f["skipped"], f["clamped"], f["papers"], *f["reasons"].values()}
    return out | {v for claim in CLAIMS for v in claim[2]() if isinstance(v, int)}


@have_real
def test_no_figure_is_a_few_queries_off_a_count():
    known = {n for n in _known_counts() if n >= 100}
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # outputs are checked line by line
        for word in re.findall(r"(?<![\w.-])\d{1,3}(?:,\d{3})+(?![\d.])|(?<![\w.,-])\d{3,6}(?![\d.,])", text):
            n = _int(word)
            near = [k for k in known if 0 < abs(n - k) <= 10]
            assert n in known or not near, f"{page.name}: {word} is not what the loader gives ({near[0]:,})"


def _check_commands() -> dict[str, str]:
    """{annotations: videos} of every check-data example of the data pages."""
    out = {}
    for page in PAGES:
        for line in re.findall(r"^mmpg check-data .*$", page.read_text(), flags=re.M):
            words = line.split()
            out[words[words.index("--annotations") + 1]] = words[words.index("--videos") + 1]
    return out


def _in_place_blocks() -> list[tuple[Path, list[str]]]:
    """Output blocks shown for the videos in place: no missing video in them."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```text\n(.*?)```", page.read_text(), flags=re.S):
            lines = block.splitlines()
            if lines[0].startswith("annotations: ") and not any("missing videos" in x for x in lines):
                found.append((page, lines))
    return found


@have_real
def test_the_output_shown_with_the_videos_in_place_is_what_check_data_prints(tmp_path, monkeypatch):
    import mmpg.data.check as check

    blocks = _in_place_blocks()
    assert {p.name for p, _ in blocks} >= {"README.md", "charades_sta.md", "activitynet_captions.md", "time_r1.md"}
    commands = _check_commands()
    monkeypatch.chdir(tmp_path)
    reports = {}
    for page, lines in blocks:
        documented = lines[0].split()[1]
        if documented not in reports:
            (tmp_path / documented).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / documented).symlink_to((REAL / COPIES[documented]).resolve())
            videos = commands[documented]
            (tmp_path / videos).mkdir(parents=True, exist_ok=True)
            stated = {}  # each video lasts what the file states (its first record), found by file name
            for s in facts(documented)["samples"].samples:
                stated.setdefault(Path(s.video).stem, s.duration)
            monkeypatch.setattr(check, "verify_video", lambda path, stated=stated: stated[Path(path).stem])
            reports[documented] = check.format_report(check.check_dataset(documented, videos, workers=1))
        printed = reports[documented].splitlines()
        for line in lines:
            assert line == "..." or line in printed, f"{page.name}: check-data does not print {line!r}"


def _margins(text: str) -> list[tuple[str, float, float]]:
    return [(text[max(0, m.start() - 200):m.start()], float(m[1]), float(m[2]))
            for m in re.finditer(r"max\((\d+(?:\.\d+)?) s, (\d+(?:\.\d+)?) ?%", text)]


def test_the_clamp_rule_stated_is_the_codes():
    from mmpg.data.check import DURATION_GAP_FRACTION, DURATION_GAP_S
    from mmpg.data.samples import END_MARGIN_FRACTION, END_MARGIN_S, ROUNDING_S

    rule = (END_MARGIN_S, 100 * END_MARGIN_FRACTION)
    for page in [*PAGES, ROOT / "README.md"]:
        text = _text(page)
        for before, seconds, percent in _margins(text):
            expected = (DURATION_GAP_S, 100 * DURATION_GAP_FRACTION) if "disagree" in before else rule
            assert (seconds, percent) == expected, f"{page.name}: max({seconds:g} s, {percent:g} %)"
        for sentence in re.split(r"(?<=[a-z)`])\.\s|\|", text):  # a clamp sentence names no other margin
            if re.search(r"clamp", sentence, re.I):
                for m in re.finditer(r"\b(?:up to|at most|within|over|by)\s+(\d+(?:\.\d+)?)\s?s\b", sentence, re.I):
                    assert float(m[1]) == END_MARGIN_S, f"{page.name}: {sentence.strip()[:160]!r}"
    for name in ("README.md", "charades_sta.md", "activitynet_captions.md"):
        assert any(m[1:] == rule for m in _margins(_text(ROOT / "data" / name))), name
    readme = _text(ROOT / "data" / "README.md")
    assert float(re.search(r"a difference up to (\S+) s \(`ROUNDING_S`\)", readme)[1]) == ROUNDING_S
    assert float(re.search(r"a start before 0 \(by more than (\S+) s\)", readme)[1]) == ROUNDING_S


def _files() -> list[Path]:
    """The docs, configs, scripts, tests, code and .gitignore (not this file: its paths are examples)."""
    return [ROOT / "README.md", ROOT / ".gitignore", *(ROOT / "docs").glob("*.md"), *(ROOT / "data").glob("*.md"),
            *(ROOT / "configs").rglob("*.yaml"), *(p for p in (ROOT / "scripts").rglob("*") if p.is_file()),
            *(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name),  # this one: examples
            *(ROOT / "mmpg").rglob("*.py")]


def _mentions(files: list[Path]) -> list[tuple[str, str]]:
    """(file, path below data/) for every relative data/... path the files name; braces expanded, placeholders
    (<id>, *, ...) cut."""
    out = []
    for path in files:
        for m in re.finditer(r"(?<![\w./-])/?data/([\w.{},<>*-]+(?:/[\w.{},<>*-]+)*)", path.read_text(errors="ignore")):
            if m[0].startswith("/"):
                continue  # an absolute path of a test's own
            for expanded in _braces(m[1]):
                parts = []
                for part in expanded.split("/"):
                    if not part or any(c in part for c in "<>*") or part.startswith("..."):
                        break
                    parts.append(part.rstrip(".,"))
                out.append((path.name, "/".join(p for p in parts if p)))
    return out


def _braces(text: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    return [x for alt in m[1].split(",") for x in _braces(text[:m.start()] + alt + text[m.end():])]


def _misnamed(mentions: list[tuple[str, str]]) -> list[str]:
    wrong = []
    for where, path in mentions:
        top, _, below = path.partition("/")
        if (ROOT / "data" / top).is_file():
            continue  # a page of data/ itself
        if top in LAYOUT:
            if below and not any(below == name or below.startswith(name + "/") for name in LAYOUT[top]):
                wrong.append(f"{where}: data/{path} (in data/{top}/ the docs use {sorted(LAYOUT[top])})")
        elif DATASET_LIKE.search(top):
            wrong.append(f"{where}: data/{path} (the dataset folders are data/{', data/'.join(LAYOUT)})")
    return wrong


def test_each_dataset_has_one_folder_everywhere():
    mentions = _mentions(_files())
    assert len(mentions) > 40  # the walk saw the docs
    wrong = _misnamed(mentions)
    assert not wrong, "one folder per dataset, named as data/README.md names it:\n" + "\n".join(wrong)
    assert set(LAYOUT) <= {p.split("/")[0] for _, p in mentions}
    ignored = (ROOT / ".gitignore").read_text().split()
    assert all(f"/data/{top}/" in ignored for top in LAYOUT), "git ignores each dataset folder"


def test_the_folder_check_catches_a_second_name(tmp_path):
    """The old pages' second Charades video folder (`Charades_v1` beside `Charades_v1_480`) and a dataset folder
    named another way are reported; the documented names are not."""
    page = tmp_path / "page.md"
    page.write_text("--videos data/charades/" + "Charades_v1 and data/" + "anet/val_2.json, data/timer1/x.json\n"
                    "data/charades/Charades_v1_480/ data/timer1/annotations/{train_2k5,tvgbench}.json data/x/y.json\n")
    assert [w.split(" (")[0] for w in _misnamed(_mentions([page]))] == [
        "page.md: data/charades/Charades_v1", "page.md: data/anet/val_2.json", "page.md: data/timer1/x.json"]
