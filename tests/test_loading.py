"""Where `load_policy` / `load_processor` look for a checkpoint: a local folder, or a hub id's snapshot in the local
Hugging Face cache (tests/test_hub_models.py: downloaded when missing). Anything else is refused at once with one
line naming the path (transformers would retry for ~25 s and then blame the network)."""

import time

import pytest

from mmpg.errors import UserError
from mmpg.models.loading import load_policy, load_processor, resolve_checkpoint


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, and an empty working directory (so relative paths surely do not
    exist)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


def _cache_model(cache, repo_id):
    """The layout `hf download` leaves: refs/main -> snapshots/<commit>/ with config.json and the weights."""
    commit = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "snapshots" / commit / "model.safetensors").write_text("")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.mark.parametrize("load,path", [
    (load_policy, "models/q25"),  # one slash, like a hub id: the case transformers sent to the network
    (load_processor, "nonexistent-dir/x"),
    (load_policy, "Qwen/Qwen2.5-VL-7B-Instruct"),  # a real hub id, not downloaded
    (load_processor, "models/qwen/q25"),  # not a hub id at all
    (load_policy, "./models/q25"),
    (load_processor, "../q25"),
])
def test_missing_checkpoint_is_refused_at_once(hub_cache, load, path):
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        load(path)
    assert time.monotonic() - t0 < 2
    message = str(err.value)
    assert message.startswith(f"no checkpoint folder at {path}") and "\n" not in message


def test_hub_id_message_says_how_to_download(hub_cache):
    with pytest.raises(UserError, match=r"model Qwen/Qwen2.5-VL-7B-Instruct is not in the Hugging Face cache "
                                        r".*`hf download Qwen/Qwen2.5-VL-7B-Instruct`"):
        resolve_checkpoint("Qwen/Qwen2.5-VL-7B-Instruct")
    with pytest.raises(UserError) as err:
        resolve_checkpoint("models/qwen/q25")
    assert "download" not in str(err.value)  # cannot be a hub id: no advice to download it


def test_cached_hub_id_is_its_snapshot_folder(hub_cache):
    snapshot = _cache_model(hub_cache, "owner/name")
    assert resolve_checkpoint("owner/name") == str(snapshot)


def test_local_folder_wins_and_needs_config(hub_cache):
    _cache_model(hub_cache, "owner/name")
    (hub_cache.parent / "work" / "owner" / "name").mkdir(parents=True)  # a local folder of the same name
    with pytest.raises(UserError, match=r"^owner/name: no config.json here"):
        resolve_checkpoint("owner/name")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_tiny_checkpoint_loads(tiny_dirs, family, monkeypatch):
    path = tiny_dirs[family]
    model, processor = load_policy(path), load_processor(path)
    assert model.config.model_type == family and processor is not None
    monkeypatch.chdir(path.parent)
    assert resolve_checkpoint(path.name) == path.name  # a relative folder that exists is used as it is
