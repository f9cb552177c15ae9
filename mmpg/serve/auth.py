"""The vLLM server's shared token: who may sample from it and change its weights once it listens beyond 127.0.0.1.

A server on a node of its own (`mmpg vllm-serve --host NAME`, the trainer's rollout.vllm_url=http://NAME:PORT) is
reachable by every machine that reaches that node, and POST /update_weights loads whatever file it is told. So a
server bound to anything but a loopback address refuses to start without a token (`bind_refusal`), and then answers
every request without `Authorization: Bearer TOKEN` with 401. Both sides read the token from $MMPG_VLLM_TOKEN (the
server also from --token), so it stays out of command lines, configs and run directories; every trainer rank sends it
(`mmpg.serve.wire.call`). Standard library only: the trainer imports this too.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

TOKEN_ENV = "MMPG_VLLM_TOKEN"


def client_token(env=None) -> str | None:
    """The token this process sends, from $MMPG_VLLM_TOKEN (None when unset or empty)."""
    return (os.environ if env is None else env).get(TOKEN_ENV) or None


def auth_header(env=None) -> dict[str, str]:
    """{"Authorization": "Bearer TOKEN"}, or {} without a token."""
    token = client_token(env)
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (this node's on the cluster network) or "" (every interface)


def bind_refusal(host: str, token: str | None) -> str | None:
    """Why the server must not start on `host` without a token (one line), or None."""
    if token or is_loopback(host):
        return None
    return (f"--host {host or '(every address)'} serves every machine that reaches this one, and POST "
            f"/update_weights loads any file it names: give the server a shared token ({TOKEN_ENV}=... in its "
            "environment, or --token), and the trainer the same in its own environment")


def refusal(header: str | None, token: str | None) -> str | None:
    """Why a request with this Authorization header is refused (401), or None when it may pass."""
    if not token:
        return None
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    sent = "sent none" if not header else "sent another"
    return (f"this vLLM server needs its shared token and the client {sent}: set {TOKEN_ENV} to the server's in the "
            "environment of every trainer process")
