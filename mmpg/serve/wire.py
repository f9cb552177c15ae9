"""What travels between `VLLMEngine` and the vLLM server, and the client side of HTTP (stdlib only, timeouts always).

A generate request is one safetensors blob: its `__metadata__["request"]` is JSON (prompts' token ids, sampling
settings, video metadata) and its tensors are the decoded frames [T, H, W, 3] (uint8 when the frames are whole
numbers, else float32: no rounding on the way). safetensors because both venvs have it, it is a documented format
(8-byte little-endian header length, JSON header, raw buffers) and it carries large frames without base64.
Answers are JSON. A weight update names a safetensors file that the trainer wrote (same host, /dev/shm when there).

Versions (`WIRE_VERSION`; the request's "wire", the server's /health "wire"; absent means 1):
    1  each prompt carries its own video: tensor `video_{b}`, prompt["video"] = {"key", "metadata"}. A video asked
       by K queries travels K times and vLLM hashes its frames K times.
    2  a table of the batch's distinct videos, request["videos"] = [{"key": "video_{v}", "metadata"}], tensors
       `video_{v}`; prompt["video"] = v (its index) or None. Each video travels once; the server names it by its
       content (`video_digest`, hashed once) and hands vLLM that name as the item's `multi_modal_uuids`, so vLLM
       neither hashes the frames again nor runs its processor on them more than once.
    3  as 2, and a prompt may hold several videos: prompt["videos"] = [v, ...], the table's videos in the order of
       the prompt's video tokens (a multi-turn conversation: the overview, then the clips of its tool turns); the
       server's /health says how many one prompt may hold ("videos_per_prompt", its --videos-per-prompt).
A server answers every version up to its own; a client refuses an older server (`check_wire`), and a server refuses
a request newer than itself, each with one line saying what to restart.

Errors the client can meet are `ServerError`s whose message says what to do: no server, a timeout, the server
refusing a request (its message passed on; 401: the shared token, which every request carries from $MMPG_VLLM_TOKEN,
`mmpg.serve.auth`).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import urllib.error
import urllib.request

import numpy as np

from mmpg.serve.auth import auth_header

DEFAULT_URL = "http://127.0.0.1:8000"
REQUEST_KEY = "request"
WIRE_VERSION = 3  # see the module docstring


class ServerError(RuntimeError):
    """The vLLM server is unreachable, timed out or refused a request (`status`: its HTTP status, 0 when none:
    409 means the server restarted since the client last synced its weights)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def pack(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """meta (JSON-able) + named arrays -> one safetensors blob."""
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata={REQUEST_KEY: json.dumps(meta)})


def unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The inverse of `pack`."""
    from safetensors.numpy import load

    if len(blob) < 8:
        raise ValueError("request body is not a safetensors blob (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = json.loads(header.get("__metadata__", {}).get(REQUEST_KEY, "{}"))
    return meta, load(blob)


def check_wire(health: dict, url: str) -> None:
    """Refuse a server that cannot read this client's requests (its /health says which version it speaks)."""
    theirs = int(health.get("wire", 1))
    if theirs < WIRE_VERSION:
        raise ServerError(f"the vLLM server at {url} speaks wire format {theirs}, this client {WIRE_VERSION} (a video "
                          "sent once per batch, several videos per prompt): it is an older mmpg vllm-serve; restart "
                          "it from this checkout (scripts/vllm_serve.sh)")


def video_digest(frames: np.ndarray, metadata: dict) -> str:
    """A name for a video's content: frames (dtype, shape, bytes) and metadata (fps and frames_indices set Qwen3-VL's
    timestamps). Equal names mean equal inputs to vLLM's processor, so vLLM may reuse what it computed for one.
    blake3 where installed (vLLM's own hash, a dependency of vllm: ~1.5 GB/s here), else sha256."""
    try:
        from blake3 import blake3 as hasher
    except ImportError:
        hasher = hashlib.sha256
    h = hasher()
    arr = np.ascontiguousarray(frames)
    h.update(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(memoryview(arr).cast("B"))
    h.update(json.dumps(metadata, sort_keys=True, default=str).encode())
    return f"mmpg-video-{getattr(hasher, '__name__', 'hash')}-{h.hexdigest()}"


def frames_array(frames) -> np.ndarray:
    """[T, C, H, W] frames (torch or numpy, 0..255) -> [T, H, W, C] uint8 if every value is a whole number, else
    float32 (the values as the trainer's processor saw them)."""
    arr = frames.detach().cpu().numpy() if hasattr(frames, "detach") else np.asarray(frames)
    if arr.ndim != 4 or arr.shape[1] not in (1, 3):
        raise ValueError(f"frames must be [T, C, H, W] with C = 3, got shape {arr.shape}")
    arr = arr.transpose(0, 2, 3, 1)
    if arr.dtype == np.uint8:
        return arr
    if np.array_equal(arr, np.round(arr)) and arr.min() >= 0 and arr.max() <= 255:
        return arr.astype(np.uint8)
    return arr.astype(np.float32)


def call(url: str, path: str, *, body: bytes | None = None, payload: dict | None = None, timeout: float,
         what: str = "", setting: str = "rollout.vllm_timeout_s") -> dict:
    """POST `body` (bytes) or `payload` (JSON), or GET when both are None; returns the JSON answer. setting: the
    config key of `timeout`, named in a timeout's message.

    Raises ServerError: connection refused or reset (no server, or it died), a timeout, or an error status (with the
    server's own message)."""
    data, headers = body, {"Content-Type": "application/octet-stream"}
    if payload is not None:
        data, headers = json.dumps(payload).encode(), {"Content-Type": "application/json"}
    headers.update(auth_header())  # the server's shared token, when $MMPG_VLLM_TOKEN gives one
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers,
                                 method="GET" if data is None else "POST")
    label = what or path
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except (ValueError, OSError):  # not our JSON: some other server on that port
            message = e.reason
        raise ServerError(f"vLLM server at {url} refused {label} (HTTP {e.code}): {message}", e.code) from None
    except TimeoutError:
        raise ServerError(f"vLLM server at {url} did not answer {label} within {timeout:g} s ({setting}); it may be "
                          "overloaded or stuck: check its log") from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ServerError(f"vLLM server at {url} did not answer {label} within {timeout:g} s ({setting}); "
                              "check its log") from None
        raise ServerError(f"no vLLM server at {url} ({reason}) for {label}; start one with `mmpg vllm-serve "
                          "--checkpoint MODEL_DIR` (scripts/vllm_serve.sh) or set rollout.vllm_url") from None
