"""Models by name: a hub id (`Qwen/Qwen2.5-VL-7B-Instruct`) in model.path, `mmpg eval --checkpoint` or `mmpg
vllm-serve --checkpoint` becomes a local snapshot folder of the Hugging Face cache, downloaded once per node.

    resolve_model("Qwen/Qwen2.5-VL-7B-Instruct").folder   # HF_HOME/hub/models--Qwen--.../snapshots/<commit>

The cache first: a complete snapshot of the cached `main` is used without asking the hub, so a second or resumed
run, its reference model and the vLLM server all load the revision the first run downloaded (run.json records its
commit), and a node without internet needs no HF_HUB_OFFLINE. Only a missing or partial snapshot is downloaded
(`snapshot_download`, with its progress bars); `hf download REPO` moves the cached `main` to the hub's newest.

Once per node: local rank 0 downloads; the other local ranks wait on a file lock in the temp folder, before
torch.distributed is up. A lock, not a barrier: the download (16 GB for a 7B model) may outlast a collective's
timeout and comes before the process group exists; a failing rank 0 exits and the launcher ends the others. Without
LOCAL_RANK every process is rank 0 and the lock still lets one download. Offline (HF_HUB_OFFLINE=1) every rank reads
the cache on its own. This module imports only the standard library, huggingface_hub (inside functions) and
`mmpg.errors`: the vLLM server (`mmpg.serve`, in its own venv) resolves its --checkpoint with it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from mmpg.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # `name` or `owner/name`
# files a Qwen-VL checkpoint folder never loads from (other frameworks' weights, originals, quantized exports)
IGNORE = ["*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.pth", "original/*", "onnx/*"]
WAIT_S = 6 * 3600.0  # a non-zero local rank's longest wait for rank 0's download (16 GB at 1 MB/s: 4.5 h)
POLL_S = 1.0
_SNAPSHOT = re.compile(r"^models--(?P<repo>.+)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """Where a model.path points: `folder` holds config.json. repo_id and revision (the snapshot's commit hash) for a
    hub id, or for a folder inside a Hugging Face cache; None for any other folder."""

    path: str  # as the user gave it
    folder: str
    repo_id: str | None = None
    revision: str | None = None

    def record(self) -> dict:
        """run.json's "model"."""
        return dataclasses.asdict(self)


_resolved: dict[tuple[str, str], ResolvedModel] = {}  # (hub id, cache folder) -> its snapshot, once per process


def is_hub_id(text: str) -> bool:
    """`owner/name` or `name` that is not a folder here (a path starting with /, ., ~ never is)."""
    return bool(HUB_ID.match(text)) and ".." not in text and not Path(text).expanduser().exists()


def resolve_model(path: str | os.PathLike) -> ResolvedModel:
    """The local folder of `path`: an existing folder (it must hold config.json), or a hub id's snapshot in the
    Hugging Face cache, downloaded first when the cache lacks it (local rank 0; the others wait). Anything else, and
    a hub id that cannot be had, is one UserError line saying what to do."""
    text = str(path)
    local = Path(text).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"{text}: no config.json here; point at a checkpoint folder (mmpg make-tiny builds one)")
        return ResolvedModel(text, str(local), *cache_identity(local))
    if not is_hub_id(text):
        raise UserError(f"no checkpoint folder at {text}; point at a local checkpoint folder or a hub id "
                        "(owner/name)")
    cache = hub_cache()
    known = _resolved.get((text, cache))
    if known is not None and (Path(known.folder) / "config.json").is_file():
        return known
    folder = _fetch(text, cache)
    commit = Path(folder).name
    found = ResolvedModel(text, folder, text, commit if _COMMIT.match(commit) else None)
    _resolved[(text, cache)] = found
    return found


def identify(path: str | os.PathLike) -> ResolvedModel:
    """What run.json records for model.path: a hub id resolved (`resolve_model`); a local path as it is (its absolute
    folder, with the hub id and commit where it is a cache snapshot), unchecked: loading it says what is wrong."""
    text = str(path)
    if is_hub_id(text):
        return resolve_model(text)
    local = Path(text).expanduser().absolute()
    return ResolvedModel(text, str(local), *cache_identity(local))


def local_folder(path: str | os.PathLike) -> str:
    """`resolve_model(path).folder`: what to hand `from_pretrained`."""
    return resolve_model(path).folder


def cache_identity(folder: Path) -> tuple[str | None, str | None]:
    """(repo id, commit) of a folder that is a snapshot of a Hugging Face cache (models--owner--name/snapshots/C),
    else (None, None): the launch script hands the vLLM server such a folder."""
    folder = folder.expanduser().absolute()
    repo = _SNAPSHOT.match(folder.parent.parent.name)
    if folder.parent.name != "snapshots" or repo is None or not _COMMIT.match(folder.name):
        return None, None
    return repo.group("repo").replace("--", "/"), folder.name


def hub_cache() -> str:
    """The Hugging Face hub cache, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub), as
    huggingface_hub reads it when it is imported: a process forked after that import sees its own environment."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return str(Path(os.environ[key]).expanduser())
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE (else TRANSFORMERS_OFFLINE) as the environment says now; huggingface_hub's constant where
    neither is set."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(key, "") != "":
            return os.environ[key].upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_command(action: str) -> str:
    """The installed huggingface_hub's command for `action` ("download REPO", "login"): `hf ...` from 0.34 on (the
    release that added it; 1.0 removed `huggingface-cli`), `huggingface-cli ...` before."""
    if _hub_version() >= (0, 34):
        return f"hf {'auth login' if action == 'login' else action}"
    return f"huggingface-cli {action}"


def _hub_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = re.findall(r"\d+", version("huggingface_hub"))[:2]
    except PackageNotFoundError:
        return (0, 0)
    return tuple(int(p) for p in parts) if len(parts) == 2 else (0, 0)


def missing_files(folder: str | Path) -> list[str]:
    """What a snapshot folder lacks to load: config.json, and the weights (each shard its index names, or one
    model.safetensors / pytorch_model.bin). huggingface_hub >= 2 checks a snapshot against the hub's file list
    itself where it cached one; this covers older ones and caches copied by hand."""
    folder = Path(folder)
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError):
                return missing + [f"{index} (unreadable)"]
            return missing + [s for s in shards if not (folder / s).is_file()]
    if not any((folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        missing.append("model.safetensors")
    return missing


def _cached(repo_id: str, cache: str) -> tuple[str | None, str]:
    """(the cached snapshot of `main`, "") when it is complete, else (None, why), without the network."""
    import huggingface_hub

    try:
        folder = huggingface_hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=True,
                                                   ignore_patterns=IGNORE)
    except Exception as err:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), partial (IncompleteSnapshotError)
        partial = re.search(r"(\d+) file\(s\) are missing", str(err))  # IncompleteSnapshotError's
        return None, f"a partial snapshot: {partial.group(1)} file(s) missing" if partial else ""
    missing = missing_files(folder)
    if missing:
        return None, f"a partial snapshot: it lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    return folder, ""


def _fetch(repo_id: str, cache: str) -> str:
    folder, why = _cached(repo_id, cache)
    if folder is not None:
        return folder
    if offline():
        raise UserError(f"no checkpoint folder at {repo_id}, and model {repo_id} is not in the Hugging Face cache "
                        f"{cache}{f' ({why})' if why else ''} while HF_HUB_OFFLINE is set; download it where the hub "
                        f"can be reached: `{hub_command('download ' + repo_id)}`")
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        return _wait_for_rank0(repo_id, cache)
    return _download(repo_id, cache)


def _lock(repo_id: str, cache: str):
    """The node's lock for downloading `repo_id` into `cache` (the temp folder: one per node, also where the cache
    is shared or read-only)."""
    from filelock import FileLock

    folder = Path(tempfile.gettempdir()) / f"mmpg-hub-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(f"{cache}\n{repo_id}".encode()).hexdigest()[:16]
    return FileLock(str(folder / f"{repo_id.replace('/', '--')}-{key}.lock"))


def _download(repo_id: str, cache: str) -> str:
    """Local rank 0 (or a lone process): the snapshot of `main`, downloaded under the node's lock."""
    from filelock import Timeout

    lock = _lock(repo_id, cache)
    try:
        lock.acquire(timeout=2)
    except Timeout:
        _say(f"waiting for another process on this node that is downloading {repo_id}")
        lock.acquire()
    try:
        folder, _ = _cached(repo_id, cache)  # that process may have finished it
        if folder is not None:
            return folder
        _say(f"downloading {repo_id} into {cache} (once per node; later runs use the cache)")
        return _snapshot(repo_id, cache)
    finally:
        lock.release()


def _snapshot(repo_id: str, cache: str) -> str:
    import huggingface_hub

    pinned = _cached_commit(repo_id, cache)  # a partial snapshot is completed at its own revision
    try:
        folder = huggingface_hub.snapshot_download(repo_id, cache_dir=cache, revision=pinned,
                                                   ignore_patterns=IGNORE)
    except Exception as err:  # noqa: BLE001 - the hub's errors (OSErrors), a proxy's, the transfer's: one line
        raise _hub_error(repo_id, cache, err) from None
    missing = missing_files(folder)
    if missing:
        raise UserError(f"model {repo_id}: the snapshot {folder} lacks {', '.join(missing[:3])} after the download "
                        "(the hub could not be reached to complete it, or it is not a transformers checkpoint)")
    return folder


def _cached_commit(repo_id: str, cache: str) -> str | None:
    ref = Path(cache) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.match(commit) else None


def _hub_error(repo_id: str, cache: str, err: Exception) -> UserError:
    """One line for what snapshot_download raised (huggingface_hub's errors are OSErrors)."""
    from huggingface_hub import errors

    kind = type(err).__name__
    if isinstance(err, errors.GatedRepoError):
        return UserError(f"model {repo_id} is gated: accept its terms on its hub page, then log in here with "
                         f"`{hub_command('login')}` (or set HF_TOKEN)")
    if isinstance(err, errors.RepositoryNotFoundError):
        return UserError(f"no checkpoint folder at {repo_id}, and no such model on the Hugging Face hub (or it is "
                         f"private: log in with `{hub_command('login')}` or set HF_TOKEN)")
    if isinstance(err, errors.RevisionNotFoundError):
        return UserError(f"model {repo_id}: the hub no longer has the revision cached here; update the cache with "
                         f"`{hub_command('download ' + repo_id)}`")
    if getattr(err, "errno", None) == errno.ENOSPC:
        return UserError(f"model {repo_id}: no space left on the disk of {cache}; free some, or point HF_HOME at a "
                         "larger disk")
    if isinstance(err, (errors.LocalEntryNotFoundError, getattr(errors, "IncompleteSnapshotError", ()))):
        return UserError(f"no checkpoint folder at {repo_id}, and model {repo_id} is not (completely) in the Hugging "
                         f"Face cache {cache} while the hub cannot be reached; download it where it can: "
                         f"`{hub_command('download ' + repo_id)}`")
    return UserError(f"model {repo_id}: the download failed ({kind}: {_first_line(err)}); retry, or download it "
                     f"with `{hub_command('download ' + repo_id)}`")


def _wait_for_rank0(repo_id: str, cache: str) -> str:
    """A non-zero local rank: the snapshot once local rank 0 has downloaded it (read under the lock rank 0 holds
    while it downloads, so never half-written). Ends when the launcher does (rank 0 failed: it ends the others)."""
    from filelock import Timeout

    lock, parent, t0, said = _lock(repo_id, cache), os.getppid(), time.monotonic(), 0.0
    while True:
        try:
            with lock.acquire(timeout=POLL_S):
                folder, _ = _cached(repo_id, cache)
            if folder is not None:
                return folder
        except Timeout:
            pass  # rank 0 is downloading
        waited = time.monotonic() - t0
        if os.getppid() != parent:
            raise UserError(f"the launcher ended while this rank waited for local rank 0 to download {repo_id}")
        if waited > WAIT_S:
            raise UserError(f"local rank 0 has not downloaded {repo_id} into {cache} in {WAIT_S / 3600:.0f} h; "
                            f"download it first with `{hub_command('download ' + repo_id)}`")
        if waited - said >= 60:
            said = waited
            _say(f"local rank {os.environ.get('LOCAL_RANK')} waiting for local rank 0 to download {repo_id} "
                 f"({waited / 60:.0f} min)")
        time.sleep(POLL_S)


def _say(line: str) -> None:
    print(f"[mmpg] {line}", file=sys.stderr, flush=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= 300 else line[:300] + " ..."


def main(argv: list[str] | None = None) -> int:
    """`python -m mmpg.models.hub MODEL`: the folder to load MODEL from, on stdout (a hub id's snapshot, downloaded
    first where needed; any other path unchanged). The launch script hands it to the vLLM server."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mmpg.models.hub MODEL", file=sys.stderr)
        return 2
    try:
        print(resolve_model(args[0]).folder if is_hub_id(args[0]) else args[0])
    except UserError as err:
        print(f"mmpg: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
