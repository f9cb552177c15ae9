"""The `mmpg` command: bad input gives one clear line, exit status 2, and leaves nothing half-written."""

from __future__ import annotations

import subprocess
import sys

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
    assert len(err.splitlines()) == 1 and "unknown model family 'llama'" in err
    assert not (tmp_path / "m").exists()


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
    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "-m", "mmpg.cli", "make-tiny", "--family", "qwen2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny qwen2 checkpoint" in proc.stdout
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".tiny.tmp-*"))
