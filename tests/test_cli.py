"""The `mmpg` command: bad input gives one clear line, exit status 2, and leaves nothing half-written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmpg.cli import main


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse rejects bad flags itself, also with status 2
        code = exit_.code
    err = capsys.readouterr().err.strip()
    return code, err


def test_unknown_family(tmp_path, capsys):
    code, err = _run(["make-tiny", "--family", "llama", "--out", str(tmp_path / "m")], capsys)
    assert code == 2
    assert "argument --family: invalid choice: 'llama'" in err.splitlines()[-1]
    assert not (tmp_path / "m").exists()


def test_make_tiny_lists_the_families_it_builds(capsys):
    from mmpg.cli import TINY_FAMILIES, ZOOM_RULES
    from mmpg.toy.models import FAMILIES
    from mmpg.toy.zoom_task import WINDOW_RULES

    assert TINY_FAMILIES == FAMILIES and ZOOM_RULES == WINDOW_RULES  # synth --zoom-rule's choices
    with pytest.raises(SystemExit) as exit_:
        main(["make-tiny", "--help"])
    assert exit_.value.code == 0 and "--family {qwen2_5_vl,qwen3_vl,qwen2,qwen3}" in capsys.readouterr().out


def test_version(capsys):
    from mmpg import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"mmpg {__version__}"


def _old_transformers(monkeypatch):
    from mmpg.grouping import patch

    monkeypatch.setattr(patch.transformers, "__version__", "5.16.1")
    patch._check_transformers()


def _missing_feature(monkeypatch):
    from mmpg.grouping import patch

    patch._check_features(SimpleNamespace(config=SimpleNamespace(model_type="qwen2_5_vl"), model=SimpleNamespace()))


def _ignored_input(monkeypatch):
    import torch

    from mmpg.grouping.attention import check_tripwire

    check_tripwire(("mm_encoder_outputs",), {"mm_encoder_outputs": None}, torch.nn.Identity(), "prefill")


@pytest.mark.parametrize("situation, says", [(_old_transformers, "tested on transformers >="),
                                             (_missing_feature, "no longer takes the visual inputs"),
                                             (_ignored_input, "mm_encoder_outputs handed to the model's forward")])
def test_an_unsupported_transformers_is_one_line_and_exit_2(monkeypatch, capsys, situation, says):
    """What mmpg.grouping raises for the user's transformers (its own RuntimeError subclasses: it imports no other
    mmpg package) is shown as every user error is; any other exception still raises with its traceback."""
    import mmpg.cli

    monkeypatch.setattr(mmpg.cli, "_cmd_synth", lambda args: situation(monkeypatch))
    code, err = _run(["synth", "--out", "x", "--n", "1"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("mmpg: error: ") and says in err
    monkeypatch.setattr(mmpg.cli, "_cmd_synth", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["synth", "--out", "x", "--n", "1"])


def test_make_tiny_refuses_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _run(["make-tiny", "--family", "qwen2", "--out", str(out)], capsys)
    assert code == 2 and "is not empty; pass --overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("n", ["0", "-3", "two"])
def test_synth_rejects_bad_counts(tmp_path, capsys, n):
    code, err = _run(["synth", "--out", str(tmp_path / "s"), "--n", n], capsys)
    assert code == 2 and "positive integer" in err
    assert not (tmp_path / "s").exists()


def test_synth_refuses_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / "x").write_text("x")
    code, err = _run(["synth", "--out", str(out), "--n", "1"], capsys)
    assert code == 2 and "not empty" in err
    assert [p.name for p in out.iterdir()] == ["x"]


def test_negative_seed(tmp_path, capsys):
    code, err = _run(["make-tiny", "--family", "qwen2", "--out", str(tmp_path / "m"), "--seed", "-1"], capsys)
    assert code == 2 and "integer >= 0" in err


def test_console_script_make_tiny(tmp_path):
    """The installed `mmpg` command (pyproject's [project.scripts], beside this python), as a user runs it."""
    exe = shutil.which("mmpg", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the mmpg console script is not installed beside this python (pip install -e .)")
    out = tmp_path / "tiny"
    proc = subprocess.run([exe, "make-tiny", "--family", "qwen2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny qwen2 checkpoint" in proc.stdout
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".tiny.tmp-*"))


def test_the_docker_images_default_command_is_mmpg_help():
    """`docker run mmpg` runs the image's ENTRYPOINT with its CMD: here `bash -c "mmpg --help"`, which prints the
    commands and exits 0 on any host (no GPU, no data mounted needed)."""
    import json
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    lines = (root / "Dockerfile").read_text().splitlines()
    entrypoint = json.loads(next(x for x in reversed(lines) if x.startswith("ENTRYPOINT ")).split(" ", 1)[1])
    cmd = json.loads(next(x for x in reversed(lines) if x.startswith("CMD ")).split(" ", 1)[1])
    assert entrypoint == ["/bin/bash"] and cmd == ["-c", "mmpg --help"]
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the image's PATH has it
    proc = subprocess.run(["bash", *cmd], capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mmpg") and "make-tiny" in proc.stdout and "demo" in proc.stdout


def test_python_dash_m_mmpg_is_the_command(monkeypatch, capsys):
    """`python -m mmpg` runs mmpg/__main__.py: the same parser and exit code as the console script."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["mmpg", "make-tiny", "--family", "qwen2", "--out", "x", "--seed", "-1"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mmpg", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2 and "integer >= 0" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["mmpg", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mmpg", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: mmpg ") and " train " in out


def test_a_demo_config_before_the_demo_is_built_names_the_command(tmp_path, monkeypatch, capsys):
    # the demo's configs point into data/generated/demo; before `mmpg demo --build-only` the run stops with one
    # line naming that command (from mmpg.config.generated: a real run's path never reaches the toy world)
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml"
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data/generated/demo/tiny-qwen2_5_vl does not exist yet" in err and "mmpg demo --build-only" in err
