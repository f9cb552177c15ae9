"""Every evaluation command README.md, docs/evaluation.md and scripts/eval_grounding.sh's header tell a user to run,
run as printed on tiny stand-ins: the tiny Qwen2.5-VL checkpoint for CKPT, a one-step training run for runs/grpo,
Charades-STA / TVGBench / TimeLens-Bench files of a few records with short noise videos at the documented paths,
stand-in `curl` (the papers' prompt files: our own words in the same Python shapes, served for the pinned URLs) and
stand-in `torchrun` (NUM_GPUS=8 recorded, then one process). Each command gets only speed settings appended (small
frames, 8 new tokens). The commands are collected from the files, so a command added to the docs is run too.

Also: the script's header offers only settings that load; the papers' prompts are read from their files without
running them (`mmpg.eval.paper_prompts`), their marker made {query}, every other brace kept literal."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batches import write_mp4
from mmpg.errors import UserError
from mmpg.eval.paper_prompts import SOURCES, TIME_R1, TIMELENS, VIDEOCHAT_R1, read_paper_prompt
from mmpg.eval.settings import load_settings
from train_utils import env as cli_env
from train_utils import overrides, run_cli

ROOT = Path(__file__).resolve().parents[1]
FAST = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "total_pixels=12544", "max_new_tokens=8",
        "num_workers=0", "batch_size=4", "self_check=off"]
RUN_TIMEOUT_S = 1200

# The papers' prompt files, in their shapes (a dict entry / a triple-quoted string / implicitly joined literals next to
# code that cannot run here), in our words. {} / [EVENT] is where the sentence goes.
STANDIN_FILES = {
    TIME_R1: 'from enum import Enum\n\nDEFAULT_TG_PROMPT = {\n    "default": "Where is \\"{}\\"?",\n    "r1": """Where '
             'does "{}" happen in the video?\n\nThink inside <think> </think>, then answer {{start}} to {{end}} in '
             '<answer> </answer>."""\n}\n',
    VIDEOCHAT_R1: 'import module_that_is_not_installed\n\nGROUND_TEMPLATE_THINK = """When is "[EVENT]" shown?\n\n'
                  'Reason in <think> </think>; then <answer>START to END</answer>, e.g. {"a": 1}."""\n',
    TIMELENS: 'import torch\n\nGROUNDER_PROMPT = (\n    "Which seconds show \'{}\'? "\n    "Say: \'The event happens in '
              '<start time> - <end time> seconds\'."\n)\nLONGER = ("Frames carry times. ") + GROUNDER_PROMPT\n',
}
# ...and the {query} templates mmpg must make of them
STANDIN_TEMPLATES = {
    TIME_R1: 'Where does "{query}" happen in the video?\n\nThink inside <think> </think>, then answer {{start}} to '
             '{{end}} in <answer> </answer>.',
    VIDEOCHAT_R1: 'When is "{query}" shown?\n\nReason in <think> </think>; then <answer>START to END</answer>, e.g. '
                  '{{"a": 1}}.',
    TIMELENS: "Which seconds show '{query}'? Say: 'The event happens in <start time> - <end time> seconds'.",
}


def _noise_videos(folder: Path, seconds: dict[str, int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in seconds.items():
        write_mp4(folder / f"{name}.mp4", (rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(n)), 1)


def _standin_bin(world: Path) -> Path:
    """bin/curl serving the papers' prompt files for their pinned URLs only (else curl -f's exit status 22), and
    bin/torchrun recording its arguments and running the command once, as one process."""
    bin_dir = world / "bin"
    bin_dir.mkdir()
    served = {s.url: STANDIN_FILES[s] for s in SOURCES}
    (world / "served.json").write_text(json.dumps(served))
    (bin_dir / "curl").write_text(f"""#!{sys.executable}
import json, sys
from pathlib import Path
args = sys.argv[1:]
out, url = args[args.index("-o") + 1], [a for a in args if a.startswith("https://")][0]
served = json.loads(Path({str(world / "served.json")!r}).read_text())
if url not in served or "--create-dirs" not in args:
    sys.exit("curl: (22) The requested URL returned error: 404")
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(served[url])
""")
    (bin_dir / "torchrun").write_text(f"""#!/bin/bash
echo "$@" >> {world / "torchrun.args"}
while [ "$1" != "-m" ]; do shift; done
exec {sys.executable} "$@"
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def world(grpo_data, tmp_path_factory):
    """A folder laid out as the docs lay out a user's: data/... at the documented paths, runs/grpo a training run."""
    world = tmp_path_factory.mktemp("user")
    charades = world / "data" / "charades"
    _noise_videos(charades / "Charades_v1_480", {"3MSZA": 31, "AO8RW": 13})
    (charades / "charades_sta_test.txt").write_text("3MSZA 24.3 30.4##person turn a light on.\n3MSZA 0.0 7.2##a "
                                                    "person is putting a book on a shelf.\nAO8RW 2.5 9.1##person "
                                                    "closes the door.\n")
    from test_benchmark_files import tvgbench_list

    (world / "data" / "timer1" / "annotations").mkdir(parents=True)
    (world / "data" / "timer1" / "annotations" / "tvgbench.json").write_text(json.dumps(tvgbench_list()))
    _noise_videos(world / "data" / "timer1" / "videos" / "tvgbench_data",
                  {"KWZSA": 30, "aHDGMOQgHUE": 99, "EXYY8": 19, "s30-d52": 134, "s31-d53": 28})
    timelens = world / "data" / "timelens"
    _noise_videos(timelens / "videos" / "charades", {"3MSZA": 31, "AO8RW": 13, "KWZSA": 30})
    (timelens / "charades-timelens.json").write_text(
        (ROOT / "tests" / "fixtures" / "timelens" / "charades-timelens.json").read_text())
    demo = world / "data" / "generated" / "demo" / "easy"  # the worked example's demo data: the synthetic split
    demo.mkdir(parents=True)
    (demo / "test.json").write_text((grpo_data["synth"] / "test.json").read_text())
    (demo / "videos").symlink_to(grpo_data["synth"] / "videos")
    proc = run_cli(["train"] + overrides(grpo_data, world / "runs", "grpo", **{
        "trainer.total_steps": 1, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 0}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _standin_bin(world)
    return world


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _logical_lines(block: str, prefix: str = "") -> list[str]:
    """Commands of a shell block: continuation lines joined, comment lines dropped (`prefix` stripped first)."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw[len(prefix):] if raw.startswith(prefix) else raw
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current and not current.startswith("#"):
                lines.append(current)
            current = ""
    return lines


def _is_eval(command: str) -> bool:
    return "scripts/eval_grounding.sh" in command or re.search(r"(^|\s)mmpg eval(\s|$)", command) is not None


def documented_commands() -> dict[str, list[str]]:
    """{where: [command, ...]}: every command of docs/evaluation.md's shell blocks; README's eval commands; the
    script header's example (a curl line and the command after it)."""
    evaluation = [c for b in _blocks((ROOT / "docs" / "evaluation.md").read_text()) for c in _logical_lines(b)]
    readme = [c for b in _blocks((ROOT / "README.md").read_text()) for c in _logical_lines(b) if _is_eval(c)]
    header = (ROOT / "scripts" / "eval_grounding.sh").read_text().split("set -euo pipefail")[0]
    example = [c for c in _logical_lines("\n".join(line for line in header.splitlines() if line.startswith("#   ")),
                                         "#   ")
               if c.startswith(("curl ", "NUM_GPUS=", "bash ")) and "[" not in c]
    return {"docs/evaluation.md": evaluation, "README.md": readme, "scripts/eval_grounding.sh": example}


# Placeholders the docs use, as the stand-in world fills them.
PLACEHOLDERS = {"CKPT": None, "runs/RUN": "runs/grpo", "runs/grpo/checkpoints/step_00000200":
                "runs/grpo/checkpoints/step_00000001", "TEST_ANN": "data/charades/charades_sta_test.txt",
                "ANN": "data/charades/charades_sta_test.txt", "DIR": "data/charades/Charades_v1_480"}


def _as_run(command: str, ckpt: str) -> str:
    """The command with its placeholders filled and, for an evaluation, the speed settings appended."""
    words = shlex.split(command, comments=True)
    fill = dict(PLACEHOLDERS, CKPT=ckpt)
    words = [fill.get(w, w) for w in words]
    if words[0].startswith("ckpt="):  # the worked example's checkpoint of a demo run: the tiny one here
        words = [f"ckpt={ckpt}"]
    if _is_eval(command) and "--fields" not in words:
        words += FAST
    return " ".join(shlex.quote(w) if "$" not in w else w for w in words)


def _run_commands(world: Path, ckpt: str, commands: list[str]) -> subprocess.CompletedProcess:
    lines = ["set -euo pipefail"]
    for c in commands:  # `bash scripts/...` is typed in the repository root; here it runs from the user's folder
        run = _as_run(c, ckpt).replace("bash scripts/", f"bash {ROOT}/scripts/", 1)
        lines += [f"echo {shlex.quote('+++ ' + c)}", run]
    e = cli_env()
    e.update(MMPG_EXTRAS="dev", MMPG_TORCHRUN=str(world / "bin" / "torchrun"), PATH=f"{world / 'bin'}:{e['PATH']}",
             MASTER_PORT="29500")
    return subprocess.run(["bash", "-c", "\n".join(lines)], cwd=world, env=e, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)


def test_the_header_offers_only_settings_that_load():
    header = (ROOT / "scripts" / "eval_grounding.sh").read_text().split("set -euo pipefail")[0]
    section = header.split("# Knobs")[1].split("# NUM_GPUS")[0].split("\n", 1)[1]
    knobs = re.findall(r"(?<![\w-])([a-z_]+)=([^\s]+)", section)
    assert len(knobs) >= 10, knobs
    for key, value in knobs:
        for one in value.split("|"):
            if one == "PATH":
                continue
            load_settings("default", [f"{key}={one}"])  # raises on a name the script offers but mmpg refuses
    templates = dict(knobs)["template"].split("|")
    from mmpg.data.prompts import TEMPLATES

    assert templates == list(TEMPLATES), "the header lists every template mmpg has, and only those"
    protocols = re.search(r"PROTOCOL: default \(.*?\), or a paper's: (.*?)\. ", header, flags=re.S).group(1)
    from mmpg.eval.protocols import PROTOCOLS

    assert sorted(p.strip() for p in protocols.split(",")) == sorted(set(PROTOCOLS) - {"default"})


def test_the_documented_fetch_commands_are_the_protocols_pinned_files():
    commands = [c for cs in documented_commands().values() for c in cs if c.startswith("curl ")]
    assert set(commands) == {s.fetch_command() for s in SOURCES}
    for source in SOURCES:
        assert f"prompt_file={source.save_as}" in (ROOT / "docs" / "evaluation.md").read_text()
    with pytest.raises(UserError) as err:
        load_settings("timelens")
    line = str(err.value)
    assert "\n" not in line and TIMELENS.fetch_command() in line and f"prompt_file={TIMELENS.save_as}" in line


@pytest.mark.slow
def test_every_documented_eval_command_runs_as_printed(world, grpo_data):
    docs = documented_commands()
    assert len(docs["docs/evaluation.md"]) >= 10 and len(docs["README.md"]) == 2
    assert len(docs["scripts/eval_grounding.sh"]) == 2
    ckpt = grpo_data["model"]
    for where, commands in docs.items():
        proc = _run_commands(world, ckpt, commands)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{where}: a documented command failed:\n{out[-6000:]}"
        for c in commands:
            assert f"+++ {c}" in proc.stdout
        assert proc.stdout.count("wrote ") + proc.stdout.count("already evaluated") >= \
            sum(1 for c in commands if _is_eval(c) and "--fields" not in c)
    torchrun = (world / "torchrun.args").read_text()
    assert torchrun.count("--nproc_per_node 8") == 2 and "--protocol videochat_r1" in torchrun
    assert "-m mmpg.cli eval --checkpoint" in torchrun
    # each paper's protocol prompted with the text read from its file
    seen = {}
    for info in world.rglob("eval.json"):
        info = json.loads(info.read_text())
        seen[info["protocol"]] = info["settings"]["template_text"]["user"]
    assert seen["time_r1"] == seen["tvgbench"] == STANDIN_TEMPLATES[TIME_R1]
    assert seen["videochat_r1"] == STANDIN_TEMPLATES[VIDEOCHAT_R1]
    assert seen["timelens"] == STANDIN_TEMPLATES[TIMELENS]
    from mmpg.data.prompts import TEMPLATES

    assert seen["default"] == TEMPLATES["time_r1"].user  # mmpg's own prompt where no paper's is asked for


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.variable)
def test_a_papers_prompt_is_read_from_its_file_without_running_it(source, tmp_path):
    path = tmp_path / "prompts.py"
    path.write_text(STANDIN_FILES[source])
    template = read_paper_prompt(path)
    assert template == STANDIN_TEMPLATES[source]
    rendered = template.format(query="a person {opens} the door.")
    assert rendered.count("a person {opens} the door.") == 1 and "{query}" not in rendered


def test_bad_paper_prompt_files_are_one_line(tmp_path):
    cases = {
        "none.py": ("PROMPT = 'Where is {}?'\n", "assigns none of the papers' prompts"),
        "code.py": ("GROUNDER_PROMPT = make_prompt()\n", "not a literal string"),
        "key.py": ("DEFAULT_TG_PROMPT = {'default': 'Where is {}?'}\n", "has no key 'r1'"),
        "two.py": ("GROUNDER_PROMPT = 'from {} to {}'\n", "2 {} fields"),
        "named.py": ("GROUNDER_PROMPT = 'Where is {sentence}?'\n", "a field {sentence}"),
        "marker.py": ("GROUND_TEMPLATE_THINK = 'Where is it?'\n", "holds no [EVENT]"),
        "syntax.py": ("GROUNDER_PROMPT = (\n", "not a readable Python file"),
    }
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError) as err:
            load_settings("timelens", [f"prompt_file={tmp_path / name}"])
        assert words in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
