"""Every command README.md, docs/ and data/ tell a user to run is run or checked by a test (issue: the first real run).

The commands are collected from the pages (tests/doc_commands.py), so a new line in a page is covered the moment it
is written or this test fails naming it. Each command falls to one rule:
- run as printed elsewhere: the launch lines (tests/test_gpu_layouts.py, DRY_RUN=1 on 8 stand-in GPUs), the
  evaluation commands (tests/test_eval_commands.py, on Charades-STA-, TVGBench- and TimeLens-format stand-ins),
  `mmpg check-data` examples (tests/test_data_commands.py, on the real annotation files); those tests' own
  collectors must return the command, which this test checks;
- checked here as far as the CPU allows: every `mmpg` command (also behind `torchrun ... -m mmpg.cli` and
  `python -m mmpg`) parses with mmpg's own parser, its config loads with its overrides, an eval protocol and its
  overrides are accepted; `python -m mmpg.X` names a module that exists;
- a script of scripts/ run by the test named in SCRIPTS (which must invoke it);
- a tool outside mmpg (EXTERNAL, each with the reason it is not run).
Placeholders (ANN, DIR, CKPT, RUN, ...) become stand-in values; usage forms (`[--quick | --long]`) are expanded.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from doc_commands import ROOT, Command, documented_commands, words_after_env

# placeholder word -> stand-in (paths need not exist: nothing here reads them but configs)
PLACEHOLDERS = {"ANN": "data/x/train.json", "TEST_ANN": "data/x/test.json", "DIR": "data/x/videos",
                "CKPT": "runs/x/checkpoints/step_00000001", "RUN": "runs/x", "RUN_DIR": "runs/x",
                "SFT_RUN": "runs/sft", "MODEL_DIR": "models/x", "BASE": "models/x", "CFG": "configs/cpu_demo.yaml",
                "FILE.yaml": "configs/cpu_demo.yaml", "FILE": "data/x/train.json", "N": "1", "NAME": "default",
                "GROUP": "rollout", "COMMAND": "doctor"}
CONFIG_COMMANDS = ("train", "sft", "plan", "vllm-len", "prepare-videos")
# scripts/ -> (the test that runs it, a text that test's file holds where it invokes the script)
SCRIPTS = {
    "demo.sh": ("tests/test_demo.py", "scripts/demo.sh"),
    "train_cpu_demo.sh": ("tests/test_demo.py", "train_cpu_demo.sh"),
    "test.sh": (".ci/run", "scripts/test.sh"),  # the suite itself: CI runs it on a clean clone
    "env.sh": ("tests/test_env_script.py", "scripts/env.sh"),
    "inspect.sh": ("tests/synthetic_run.py", "inspect.sh"),
    "gpu_check.sh": ("tests/test_doctor.py", "gpu_check.sh"),
    "vllm_serve.sh": ("tests/test_hub_models.py", "vllm_serve.sh"),
    "wheelhouse.sh": ("tests/test_wheelhouse.py", "wheelhouse.sh"),
    "bench.sh": ("tests/test_documented_commands.py", "def test_bench_script_dry_run"),
    "train_grounding.sh": ("tests/test_gpu_layouts.py", "train_grounding.sh"),
    "sft_grounding.sh": ("tests/test_gpu_layouts.py", "sft_grounding.sh"),
    "eval_grounding.sh": ("tests/test_eval_commands.py", "eval_grounding.sh"),
    "train_grounding.sbatch": ("tests/test_slurm.py", "train_grounding.sbatch"),  # `sbatch scripts/slurm/...`
    # experiments of docs/performance.md (minutes each): run here with mmpg stood in, their mmpg commands checked
    "queries_per_video.sh": ("tests/test_documented_commands.py", "def test_experiment_scripts_commands_parse"),
    "async_learning.sh": ("tests/test_documented_commands.py", "def test_experiment_scripts_commands_parse"),
    "zoom_learning.sh": ("tests/test_zoom_learning.py", "scripts/zoom_learning.sh"),
}
# programs outside mmpg a page shows, and why no test runs them
EXTERNAL = {
    "curl": ("downloads a paper's prompt file (tests/test_eval_commands.py holds those URLs pinned to the protocols) "
             "or a public annotation file (tests/test_data_docs.py holds its checksum against the real copy)"),
    "pip": "the package installer (scripts/env.sh is what the tests run)",
    "docker": "builds and runs the image; the image's commands are mmpg's, checked here",
    "ssh": "a port forward to a remote machine",
    "source": "activates the environment scripts/env.sh made",
    "ls": "lists a folder",
    "hf": "huggingface_hub's own download command",
    "python -m pytest": "the test runner",
    "torchrun": "torch's launcher named alone (with `-m mmpg.cli ...` its mmpg command is checked here)",
    "assignment": "a shell variable the next line uses",
    "export": "an environment variable the next lines use",
}


def _normal(text: str) -> str:
    return " ".join(shlex.split(text, comments=True))


def _variants(text: str) -> list[str]:
    """A usage form's commands: without its [options], and with each alternative of each one alone."""
    groups = re.findall(r"\[([^\[\]]+)\]", text)
    bare = re.sub(r"\s*\[[^\[\]]+\]", "", text)
    out = [bare]
    for i, group in enumerate(groups):
        for alt in group.split("|"):
            chosen = text
            for j, other in enumerate(groups):
                chosen = chosen.replace(f"[{other}]", alt.strip() if j == i else "", 1)
            out.append(chosen)
    return [" ".join(w for w in v.split() if w not in ("...", "key=value")) for v in dict.fromkeys(out)]


def _fill(words: list[str]) -> list[str]:
    out = []
    for w in words:
        for key in sorted(PLACEHOLDERS, key=len, reverse=True):  # TEST_ANN before ANN
            w = re.sub(rf"(?<![A-Za-z_]){re.escape(key)}(?![A-Za-z_])", PLACEHOLDERS[key], w)
        out.append(w)
    return out


def _mmpg_words(words: list[str]) -> list[str] | None:
    """The mmpg argv of a command that runs mmpg (`mmpg ...`, `python -m mmpg[.cli] ...`, `torchrun/deepspeed ...
    -m mmpg.cli ...`, `docker run ... mmpg -c "mmpg ..."`), else None."""
    if words[:1] == ["mmpg"]:
        return words[1:]
    if words[:3] in (["python", "-m", "mmpg"], ["python", "-m", "mmpg.cli"]):
        return words[3:]
    if words[:1] in (["torchrun"], ["deepspeed"]) and "mmpg.cli" in words:
        return [w for w in words[words.index("mmpg.cli") + 1:] if not w.startswith("--local_rank")]
    if words[:2] == ["docker", "run"] and "-c" in words:
        inner = shlex.split(words[words.index("-c") + 1])
        return inner[1:] if inner[:1] == ["mmpg"] else None
    return None


def check_reference(argv: list[str]) -> None:
    """A command named in prose or with `...` for its values (`mmpg plan --run`, `mmpg eval --annotations ...`): the
    subcommand exists and takes every --flag named."""
    from mmpg.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert argv[0] in subparsers, f"mmpg has no command {argv[0]}"
    flags = {s for a in subparsers[argv[0]]._actions for s in a.option_strings}
    unknown = [w.split("=")[0] for w in argv[1:] if w.startswith("--") and w.split("=")[0] not in flags]
    assert not unknown, f"mmpg {argv[0]} takes no {', '.join(unknown)}"


def check_mmpg(argv: list[str]) -> None:
    """mmpg's parser takes argv; a config loads with its overrides; an eval protocol takes its overrides."""
    from mmpg.cli import build_parser, take_local_rank

    argv, _ = take_local_rank(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as err:  # argparse's own message went to stderr
        raise AssertionError(f"mmpg {' '.join(argv)}: refused by the parser (exit {err.code})") from None
    if args.command in CONFIG_COMMANDS and getattr(args, "config", None):
        from mmpg.config import load_config

        assert (ROOT / args.config).is_file(), f"no config {args.config}"
        load_config(ROOT / args.config, list(args.overrides))
    if args.command == "eval":
        from mmpg.eval.settings import load_settings

        if not any(o.startswith("prompt_file=") for o in args.overrides):  # a fetched file: test_eval_commands
            load_settings(args.protocol or "default", list(args.overrides))


def rule(command: Command) -> str:
    """Which rule covers the command: 'mmpg', 'script:NAME', 'python-module', 'external:NAME'; '' for none."""
    env, words = words_after_env(command.text)
    if not words:
        return ""
    if _mmpg_words(words) is not None and not (words[0] == "docker" and "scripts/" in command.text):
        return "mmpg"
    if words[0] == "sbatch":  # Slurm's submit: the script is the first word that is not an sbatch option
        script = next((w for w in words[1:] if w.startswith("scripts/")), "")
        return f"script:{Path(script).name}" if Path(script).name in SCRIPTS else ""
    if words[0] == "bash" and len(words) > 1 and words[1].startswith("scripts/"):
        name = Path(words[1]).name
        return f"script:{name}" if name in SCRIPTS else ""
    if words[0] == "docker":
        return "external:docker"
    if re.match(r"^[a-z_]+=", words[0]):
        return "external:assignment"
    if words[:2] == ["python", "-m"] and len(words) > 2:
        if words[2] == "pytest":
            return "external:python -m pytest"
        return "python-module" if words[2].startswith("mmpg.") else ""
    return f"external:{words[0]}" if words[0] in EXTERNAL else ""


COMMANDS = documented_commands()


def test_the_collector_sees_blocks_continuations_and_inline_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `mmpg plan --published` or `model.path` (a name).\n\n```bash\nNUM_GPUS=8 bash scripts/"
                    "train_grounding.sh CFG \\\n  a=1   # the comment\n# a comment line\n```\n\n```text\nmmpg out\n"
                    "```\n")
    found = documented_commands([page])
    assert [(c.where.split(":")[1], c.text, c.inline) for c in found] == [
        ("1", "mmpg plan --published", True), ("4", "NUM_GPUS=8 bash scripts/train_grounding.sh CFG a=1", False)]


def test_every_documented_command_has_a_rule():
    assert len(COMMANDS) > 100, len(COMMANDS)  # the pages' commands were found
    missing = [f"{c.where}: {c.text}" for c in COMMANDS if not rule(c)]
    assert not missing, "commands no test runs or checks (add a rule in tests/test_documented_commands.py):\n" + \
        "\n".join(missing)


def test_an_unknown_command_or_script_has_no_rule():
    assert rule(Command("x:1", "bash scripts/new_thing.sh", False)) == ""
    assert rule(Command("x:1", "wget https://example.org/file", False)) == ""
    assert rule(Command("x:1", "python -m somewhere_else", False)) == ""


@pytest.mark.parametrize("command", [c for c in COMMANDS if rule(c) == "mmpg"], ids=lambda c: c.where)
def test_mmpg_commands_parse_and_their_configs_load(command):
    for variant in _variants(command.text):
        _, words = words_after_env(variant)
        argv = _fill(_mmpg_words(words))
        if argv in ([], ["doctor"]) and "COMMAND" in variant:
            continue
        # prose names a command with some of its flags (`mmpg plan --run`, `mmpg synth --easy --queries 3`); a
        # shell block gives the whole command, unless `...` stands for the rest
        if ("..." in command.text or command.inline) and "--config" not in argv:
            check_reference([w for w in argv if not w.startswith("--local_rank")])
        else:
            check_mmpg(argv)


def test_a_bad_mmpg_command_is_caught():
    with pytest.raises(AssertionError, match="takes no --nope"):
        check_reference(["plan", "--run", "--nope"])
    with pytest.raises(AssertionError, match="has no command"):
        check_reference(["planner"])
    with pytest.raises(AssertionError, match="refused by the parser"):
        check_mmpg(["plan", "--gpus", "8", "--no-such-flag"])
    from mmpg.errors import UserError

    with pytest.raises(UserError):
        check_mmpg(["train", "--config", "configs/cpu_demo.yaml", "rollout.nn=8"])
    with pytest.raises(UserError):
        check_mmpg(["eval", "--checkpoint", "c", "--annotations", "a", "--videos", "v", "--protocol", "time_r1",
                    "no_such_setting=1"])


def test_launch_arguments_load_as_configs():
    """What a launch script or sbatch passes on (CONFIG key=value ...) loads as `mmpg train` would load it."""
    checked = 0
    for c in COMMANDS:
        words = words_after_env(c.text)[1]
        script = next((i for i, w in enumerate(words) if re.match(r"scripts/.*grounding\.(sh|sbatch)$", w)), None)
        if script is None or "eval_grounding" in words[script] or "..." in words:
            continue
        rest = _fill(words[script + 1:])
        config = rest[0] if rest and rest[0].endswith(".yaml") else "configs/grounding_qwen25vl_7b.yaml"
        check_mmpg(["train", "--config", config] + [w for w in rest if "=" in w])
        checked += 1
    assert checked >= 10


def test_python_modules_exist():
    for c in COMMANDS:
        if rule(c) == "python-module":
            module = words_after_env(c.text)[1][2]
            assert importlib.util.find_spec(module) is not None, f"{c.where}: no module {module}"


def test_each_script_is_run_by_its_test():
    used = {rule(c).partition(":")[2] for c in COMMANDS if rule(c).startswith("script:")}
    assert used <= set(SCRIPTS)
    for name in used:
        test, marker = SCRIPTS[name]
        assert list((ROOT / "scripts").rglob(name)), name
        assert marker in (ROOT / test).read_text(), f"{test} does not run scripts/{name}"


def _covered_elsewhere() -> set[str]:
    """The commands the launch, eval and data tests run as printed, from their own collectors."""
    import test_data_commands
    import test_eval_commands
    import test_gpu_layouts

    found = {_normal(cmd) for _, cmd in test_gpu_layouts._doc_launches()}
    found |= {_normal(cmd) for cmds in test_eval_commands.documented_commands().values() for cmd in cmds}
    found |= {_normal(cmd) for _, cmds, _ in test_data_commands._examples() for cmd in cmds}
    return found


def _runs_elsewhere(c: Command) -> bool:
    """A launch, eval or check-data command (whole, with stand-in-able values) that its own test runs as printed."""
    if c.inline or "..." in c.text:
        return False
    if re.search(r"scripts/(train|sft|eval)_grounding\.sh|(^|\s)mmpg eval(\s|$)", c.text):
        return True
    return "mmpg check-data" in c.text and not re.search(r"\b(ANN|DIR)\b", c.text)  # placeholders: parsed here


def test_launch_eval_and_data_commands_are_run_as_printed():
    """Each launch line, eval command and check-data example of the pages is one its own test runs: a line those
    tests' collectors miss would be run nowhere."""
    covered = _covered_elsewhere()
    assert sum(map(_runs_elsewhere, COMMANDS)) >= 25
    missed = [f"{c.where}: {c.text}" for c in COMMANDS if _runs_elsewhere(c) and _normal(c.text) not in covered]
    assert not missed, "\n".join(missed)


def test_bench_script_dry_run(tmp_path):
    """`bash scripts/bench.sh` (README, docs/performance.md) with --dry-run: its default preset is planned."""
    import subprocess

    from train_utils import env

    proc = subprocess.run(["bash", "scripts/bench.sh", "--dry-run", "--out", str(tmp_path / "b.json")], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("mmpg bench --preset cpu-targets")


def test_experiment_scripts_commands_parse(tmp_path):
    """scripts/queries_per_video.sh run as docs/performance.md prints it, with `mmpg` stood in by a shell function
    that records each call (and makes the checkpoint folder a training run would): every call parses and its
    config loads. scripts/async_learning.sh's documented flags parse with its module's parser."""
    import subprocess

    from mmpg.toy.demo.async_learning import build_parser
    from train_utils import env

    record = tmp_path / "calls"
    standin = ('mmpg() { printf "%q " "$@" >> "$MMPG_RECORD"; echo >> "$MMPG_RECORD"; local a o= n=; for a; do '
               'case $a in trainer.output_dir=*) o=${a#*=};; trainer.run_name=*) n=${a#*=};; esac; done; '
               '[ -z "$n" ] || mkdir -p "$o/$n/checkpoints/step_00000001"; }; export -f mmpg; '
               'bash scripts/queries_per_video.sh "$1"')
    e = {**env(), "MMPG_RECORD": str(record)}
    proc = subprocess.run(["bash", "-c", standin, "qpv", str(tmp_path / "w")], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    calls = [shlex.split(line) for line in record.read_text().splitlines()]
    assert [c[0] for c in calls] == ["make-tiny", "synth", "sft", "eval", "train", "eval", "train", "eval"]
    for argv in calls:
        check_mmpg(argv)
    documented = [c for c in COMMANDS if "async_learning.sh" in c.text]
    assert documented
    for c in documented:
        build_parser().parse_args(words_after_env(c.text)[1][2:])
