"""Models by name: a hub id in model.path (training, SFT, eval, `mmpg vllm-serve`, the launch script) resolves to
its snapshot in the Hugging Face cache; the cache is a local mirror built here from the tiny checkpoint, in the
layout huggingface_hub leaves (blobs named by their hash, snapshots/<commit>/ of links to them, refs/main), read
with HF_HUB_OFFLINE=1. The hub itself is never asked: where a test needs it "reachable", huggingface_hub's
snapshot_download is replaced by a copy from a second mirror."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mmpg.errors import UserError
from mmpg.models import hub
from train_utils import env as cli_env
from train_utils import overrides, run_cli

ROOT = Path(__file__).resolve().parents[1]
REPO = "Org/Tiny-VL"
COMMIT = hashlib.sha1(b"first upload").hexdigest()
NEWER = hashlib.sha1(b"second upload").hexdigest()


def mirror(cache: Path, source: Path, repo_id: str = REPO, commit: str = COMMIT, skip: tuple = ()) -> Path:
    """`source`'s files as huggingface_hub caches a download of `repo_id` at `commit`; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file() and p.name not in skip):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache (HF_HOME/hub), offline, and a working folder where no relative path exists."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    return tmp_path / "hf" / "hub"


@pytest.fixture
def reachable_hub(offline_cache, tmp_path, monkeypatch, tiny_dirs):
    """The hub "reachable": snapshot_download copies REPO at COMMIT from a mirror of the hub; the calls are counted."""
    import huggingface_hub
    from huggingface_hub import constants

    remote = tmp_path / "remote"
    mirror(remote, tiny_dirs["qwen2_5_vl"])
    real, calls = huggingface_hub.snapshot_download, []

    def download(repo_id, *, cache_dir, local_files_only=False, revision=None, **kw):
        if local_files_only:
            return real(repo_id, cache_dir=cache_dir, local_files_only=True, revision=revision, **kw)
        calls.append(revision)
        name = f"models--{repo_id.replace('/', '--')}"
        for path in sorted((remote / name).rglob("*")):  # what the cache lacks, as the hub's download adds it
            dest = Path(cache_dir) / name / path.relative_to(remote / name)
            if path.is_dir() or dest.is_symlink() or dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(os.readlink(path)) if path.is_symlink() else shutil.copyfile(path, dest)
        return str(Path(cache_dir) / name / "snapshots" / (revision or COMMIT))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the node's download locks
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(hub, "_resolved", {})
    return calls


# ---------------------------------------------------------------- blocker 1: the model is fetched, or one line says how


def test_offline_without_the_model_names_the_installed_hub_command(offline_cache):
    # red before: the line said `huggingface-cli download`, which huggingface_hub >= 1.0 no longer ships
    from mmpg.models.loading import resolve_checkpoint

    with pytest.raises(UserError) as err:
        resolve_checkpoint(REPO)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"no checkpoint folder at {REPO}, and model {REPO} is not in the "
                                                f"Hugging Face cache {offline_cache}")
    assert f"`hf download {REPO}`" in line and "huggingface-cli" not in line and "HF_HUB_OFFLINE" in line


@pytest.mark.parametrize("version, download, login", [
    ((0, 30), "huggingface-cli download R", "huggingface-cli login"),
    ((0, 34), "hf download R", "hf auth login"),
    ((2, 4), "hf download R", "hf auth login")])
def test_the_command_is_the_installed_versions(monkeypatch, version, download, login):
    monkeypatch.setattr(hub, "_hub_version", lambda: version)
    assert (hub.hub_command("download R"), hub.hub_command("login")) == (download, login)


def test_the_installed_hub_ships_the_command_named():
    tool = hub.hub_command("download R").split()[0]
    assert Path(sys.executable).with_name(tool).exists(), f"{tool} is not beside {sys.executable}"


def test_a_cached_hub_id_is_its_snapshot_and_loads(offline_cache, tiny_dirs):
    from mmpg.models.loading import load_policy, load_processor

    snapshot = mirror(offline_cache, tiny_dirs["qwen2_5_vl"])
    found = hub.resolve_model(REPO)
    assert found == hub.ResolvedModel(REPO, str(snapshot), REPO, COMMIT)
    model, processor = load_policy(REPO), load_processor(REPO)
    assert model.config.model_type == "qwen2_5_vl" and processor is not None
    # the snapshot folder itself, as the launch script hands it to the server, names its hub id and commit
    assert hub.identify(str(snapshot)).record() == {"path": str(snapshot), "folder": str(snapshot),
                                                     "repo_id": REPO, "revision": COMMIT}


def test_offline_a_partial_snapshot_is_one_line(offline_cache, tiny_dirs):
    mirror(offline_cache, tiny_dirs["qwen2_5_vl"], skip=("model.safetensors",))  # a download cut short
    with pytest.raises(UserError, match=r"^no checkpoint folder at Org/Tiny-VL, and .*a partial snapshot: it lacks "
                                        r"model\.safetensors.*`hf download Org/Tiny-VL`$"):
        hub.resolve_model(REPO)


def test_reachable_hub_downloads_once_and_the_cache_wins_after(reachable_hub, offline_cache):
    first = hub.resolve_model(REPO)
    assert first.revision == COMMIT and reachable_hub == [None]  # `main`, downloaded
    hub._resolved.clear()  # a new process: the cache answers, the hub is not asked
    assert hub.resolve_model(REPO) == first and reachable_hub == [None]


def test_reachable_hub_completes_a_partial_snapshot_at_its_own_revision(reachable_hub, offline_cache, tiny_dirs):
    mirror(offline_cache, tiny_dirs["qwen2_5_vl"], skip=("model.safetensors", "config.json"))
    assert hub.resolve_model(REPO).revision == COMMIT
    assert reachable_hub == [COMMIT]  # pinned to the cached commit, not the hub's newest main


def test_every_rank_loads_the_same_revision(offline_cache, tiny_dirs, monkeypatch):
    from mmpg.config import load_config
    from mmpg.train import setup

    snapshot = mirror(offline_cache, tiny_dirs["qwen2_5_vl"])
    cfg = load_config(None, [f"model.path={REPO}"])
    gathered = iter([[COMMIT, COMMIT], [COMMIT, NEWER, NEWER]])  # what each rank's cache holds
    monkeypatch.setattr(setup.dist, "gather_objects", lambda revision: next(gathered))
    assert setup.same_model_everywhere(cfg) == {"path": REPO, "folder": str(snapshot), "repo_id": REPO,
                                                "revision": COMMIT}
    with pytest.raises(UserError, match=rf"different revisions \({COMMIT} on rank 0, {NEWER} on rank 1\).*"
                                        rf"`hf download {REPO} --revision {COMMIT}`"):
        setup.same_model_everywhere(cfg)


_RANK = """
import huggingface_hub, json, os, shutil, sys, time
from pathlib import Path

remote, log = Path(sys.argv[1]), Path(sys.argv[2])
real = huggingface_hub.snapshot_download

def download(repo_id, *, cache_dir, local_files_only=False, revision=None, **kw):
    if local_files_only:
        return real(repo_id, cache_dir=cache_dir, local_files_only=True, revision=revision, **kw)
    name = "models--" + repo_id.replace("/", "--")
    with open(log, "a") as f:
        f.write(f"local rank {os.environ['LOCAL_RANK']} downloads\\n")
    time.sleep(3)  # a slow link: the other rank must wait, not read a half-written snapshot
    shutil.copytree(remote / name, Path(cache_dir) / name, symlinks=True, dirs_exist_ok=True)
    with open(log, "a") as f:
        f.write(f"done {time.time()}\\n")
    return str(Path(cache_dir) / name / "snapshots" / json.loads(sys.argv[3]))

huggingface_hub.snapshot_download = download
from mmpg.models.hub import resolve_model
found = resolve_model("%s")
print(json.dumps({"folder": found.folder, "revision": found.revision, "at": time.time()}))
""" % REPO


def test_local_rank_0_downloads_and_the_others_wait(tmp_path, tiny_dirs):
    remote, log = tmp_path / "remote", tmp_path / "downloads.log"
    mirror(remote, tiny_dirs["qwen2_5_vl"])
    env = {k: v for k, v in cli_env().items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), LOCAL_WORLD_SIZE="2", TMPDIR=str(tmp_path))
    run = lambda rank: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", _RANK, str(remote), str(log), json.dumps(COMMIT)], env={**env, "LOCAL_RANK": rank},
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    later = run("1")  # the waiting rank comes first: it must not download, nor take an empty cache
    time.sleep(1.0)
    first = run("0")
    (out0, err0), (out1, err1) = first.communicate(timeout=120), later.communicate(timeout=120)
    assert first.returncode == 0 and later.returncode == 0, err0 + err1
    zero, one = json.loads(out0), json.loads(out1)
    lines = log.read_text().splitlines()
    assert lines[0] == "local rank 0 downloads" and len(lines) == 2, lines
    assert zero["folder"] == one["folder"] and zero["revision"] == one["revision"] == COMMIT
    assert one["at"] >= float(lines[1].split()[1])  # rank 1 returned after rank 0's download ended
    assert "downloading Org/Tiny-VL" in err0 and "downloading" not in err1


# ---------------------------------------------------------------- blocker 2: the vLLM server from a hub id


def _serve_until_backend(monkeypatch, argv) -> tuple[int | None, object]:
    """`mmpg vllm-serve ARGV` up to the vLLM engine (replaced: it records the flags it gets)."""
    from mmpg.serve import vllm_server

    seen = {}

    class Engine:
        def __init__(self, args):
            seen["args"] = args
            raise KeyboardInterrupt  # stands for the engine: main stops here

    monkeypatch.setattr(vllm_server, "Backend", Engine)
    monkeypatch.setattr(vllm_server.signal, "signal", lambda *a: None)
    try:
        return vllm_server.main(argv), None
    except KeyboardInterrupt:
        return None, seen["args"]


def test_vllm_serve_resolves_a_hub_id(offline_cache, tiny_dirs, monkeypatch):
    # red before: "Org/Tiny-VL holds no config.json; give the trainer's model.path", exit 2
    snapshot = mirror(offline_cache, tiny_dirs["qwen2_5_vl"])
    rc, args = _serve_until_backend(monkeypatch, ["--checkpoint", REPO])
    assert rc is None and args.checkpoint == str(snapshot)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_real_server_serves_a_hub_id(tmp_path_factory, tmp_path, monkeypatch):
    from mmpg.serve.wire import call
    from vllm_server import Server, tiny_vllm_checkpoint

    snapshot = mirror(tmp_path / "hf" / "hub", tiny_vllm_checkpoint("qwen2_5_vl", tmp_path_factory))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server(REPO, tmp_path / "server.log")  # in .venv-vllm, as scripts/vllm_serve.sh starts it
    try:
        server.wait()
        assert call(server.url, "/health", timeout=30)["checkpoint"] == str(snapshot)
    finally:
        server.stop()


def test_vllm_serve_without_the_model_is_one_line(offline_cache, monkeypatch, capsys):
    rc, _ = _serve_until_backend(monkeypatch, ["--checkpoint", REPO])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith(f"mmpg vllm-serve: error: no checkpoint folder at {REPO}")
    assert f"`hf download {REPO}`" in err


def test_the_server_resolves_with_what_its_venv_has():
    # mmpg/serve runs in .venv-vllm (mmpg without its dependencies): the hub module it imports needs only the
    # standard library, huggingface_hub, filelock and mmpg.errors
    allowed = {"huggingface_hub", "filelock", "mmpg", "__future__"} | set(sys.stdlib_module_names)
    tree = ast.parse((ROOT / "mmpg" / "models" / "hub.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n for n in names if n.split(".")[0] not in allowed} == set()
    assert {n for n in names if n.startswith("mmpg")} == {"mmpg.errors"}


def _launch(tmp_path, cache_env: dict, *args: str):
    """scripts/train_grounding.sh with VLLM=1 and stand-ins for the launcher and the server: (process, trainer argv,
    server argv)."""
    trainer, server = tmp_path / "deepspeed", tmp_path / "serve"
    trainer.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/trainer.args\n'  # ends once the server has started
                       f'for i in $(seq 100); do [ -f {tmp_path}/server.args ] && exit 0; sleep 0.1; done\n')
    server.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/server.args\nexec sleep 60\n')
    trainer.chmod(0o755)
    server.chmod(0o755)
    env = {**cli_env(), "MMPG_EXTRAS": "dev", "MMPG_DEEPSPEED": str(trainer), "MMPG_VLLM_SERVE": str(server),
           "VLLM": "1", "VLLM_PORT": "8431", **cache_env}
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", f"model.path={REPO}", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    read = lambda name: (tmp_path / name).read_text().strip() if (tmp_path / name).exists() else None  # noqa: E731
    return res, read("trainer.args"), read("server.args")


@pytest.mark.slow
def test_launch_script_gives_the_server_the_snapshot(tmp_path, tiny_dirs):
    snapshot = mirror(tmp_path / "hf" / "hub", tiny_dirs["qwen2_5_vl"])
    res, trainer, server = _launch(tmp_path, {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr
    assert server.startswith(f"--checkpoint {snapshot} --port 8431")
    assert f"model.path={REPO}" in trainer  # the trainer resolves the same cache itself (run.json: the revision)


@pytest.mark.slow
def test_launch_script_without_the_model_starts_nothing(tmp_path):
    res, trainer, server = _launch(tmp_path, {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 2 and len(errors) == 1 and f"`hf download {REPO}`" in errors[0], res.stderr
    assert trainer is None and server is None


# ---------------------------------------------------------------- GRPO, SFT and eval from a hub id, offline


def _hub_env(tmp_path, tiny: Path) -> tuple[dict, Path]:
    snapshot = mirror(tmp_path / "hf" / "hub", tiny)
    return {**cli_env(), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}, snapshot


@pytest.mark.parametrize("job, procs", [pytest.param("train", 2, marks=pytest.mark.slow), ("sft", 1)])
def test_training_from_a_hub_id_records_its_revision(grpo_data, tmp_path, job, procs):
    environ, snapshot = _hub_env(tmp_path, Path(grpo_data["model"]))
    extra = {"model.path": REPO, "trainer.total_steps": 1}
    if job == "sft":
        extra.update({"trainer.micro_batch_size": 1, "reward.function": ""})
    proc = run_cli([job] + overrides(grpo_data, tmp_path / "out", "hub", **extra), environ=environ, timeout=600,
                   procs=procs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "out" / "hub" / "run.json").read_text())
    assert info["model"] == {"path": REPO, "folder": str(snapshot), "repo_id": REPO, "revision": COMMIT}


def test_eval_from_a_hub_id(grpo_data, tmp_path):
    environ, _ = _hub_env(tmp_path, Path(grpo_data["model"]))
    synth = grpo_data["synth"]
    proc = run_cli(["eval", "--checkpoint", REPO, "--annotations", str(synth / "test.json"), "--videos",
                    str(synth / "videos"), "--out", str(tmp_path / "eval"), "fps=1", "max_frames=4",
                    "min_pixels=3136", "max_pixels=3136", "max_new_tokens=8", "num_workers=0", "batch_size=4"],
                   environ=environ, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "eval" / "predictions.jsonl").is_file()
