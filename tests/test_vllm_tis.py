"""Truncated importance sampling weights (`algos.truncated_is_weights`) against hand-computed numbers, and the
vLLM engine's wire format and client errors that need no server (no vLLM environment needed)."""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
import torch

from mmpg.rl import algos
from mmpg.serve.wire import ServerError, call, frames_array, pack, unpack


def test_tis_weights_by_hand():
    # token 0: pi_old 0.5, pi_rollout 0.25 -> ratio 2, capped at C = 1.5
    # token 1: pi_old 0.2, pi_rollout 0.4  -> ratio 0.5 (below the cap: kept)
    # token 2: equal                        -> 1
    # token 3: masked (NaN there)           -> 0
    old = torch.tensor([[math.log(0.5), math.log(0.2), -1.0, float("nan")]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.4), -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = algos.truncated_is_weights(old, rollout, cap=1.5, mask=mask)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0, 0.0]]), rtol=0, atol=1e-6)
    # cap 3: nothing capped, the ratio itself
    torch.testing.assert_close(algos.truncated_is_weights(old[:, :3], rollout[:, :3], cap=3.0),
                               torch.tensor([[2.0, 0.5, 1.0]]), rtol=0, atol=1e-6)


def test_tis_weights_are_constants_and_never_overflow():
    old = torch.tensor([[0.0, -200.0]], requires_grad=True)
    rollout = torch.tensor([[-500.0, 0.0]])  # ratio e^500 (capped) and e^-200 (0 in float32)
    w = algos.truncated_is_weights(old, rollout, cap=2.0)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0]]))
    # in a loss: the gradient is w times the plain policy gradient (l = -A at rho = 1, A = 1)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    per_tok, _ = algos.clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), 0.2, 0.2)
    (per_tok * torch.tensor([[2.0, 0.5]])).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5]]))


@pytest.mark.parametrize("kwargs, match", [({"cap": 0.0}, "cap"), ({"cap": 2.0, "mask": torch.ones(1, 3)}, "shape")])
def test_tis_weights_refuse_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        algos.truncated_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), **kwargs)


def test_wire_round_trip_keeps_frames_exact():
    whole = torch.randint(0, 256, (2, 3, 4, 6)).float()  # [T, C, H, W] whole numbers -> uint8 [T, H, W, C]
    frac = whole + 0.25  # resized frames: floats, sent as float32
    a, b = frames_array(whole), frames_array(frac)
    assert a.dtype == np.uint8 and a.shape == (2, 4, 6, 3) and b.dtype == np.float32
    meta, arrays = unpack(pack({"prompts": [{"n": 3}]}, {"video_0": a, "video_1": b}))
    assert meta == {"prompts": [{"n": 3}]}
    np.testing.assert_array_equal(arrays["video_0"], whole.permute(0, 2, 3, 1).numpy())
    np.testing.assert_array_equal(arrays["video_1"], frac.permute(0, 2, 3, 1).numpy())


def test_client_errors_without_a_server():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match="no vLLM server at .*mmpg vllm-serve"):
        call(f"http://127.0.0.1:{port}", "/health", timeout=5)
    with socket.socket() as s:  # a server that accepts but never answers: a timeout, not a hang
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(ServerError, match="did not answer .* within 0.5 s"):
            call(f"http://127.0.0.1:{s.getsockname()[1]}", "/health", timeout=0.5)


@pytest.mark.slow
def test_train_without_a_vllm_server_fails_fast_and_says_what_to_do(grpo_data, tmp_path):
    """rollout.engine=vllm and nothing listening: the trainer waits rollout.vllm_wait_s, then one error line."""
    from train_utils import overrides, run_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": f"http://127.0.0.1:{port}", "rollout.vllm_wait_s": 3}
    res = run_cli(["train"] + overrides(grpo_data, tmp_path, "novllm", **extra), timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "no vLLM server at" in res.stderr and "mmpg vllm-serve" in res.stderr and "waited 3 s" in res.stderr
    bad = run_cli(["train"] + overrides(grpo_data, tmp_path, "t2", **{"rollout.engine": "vllm",
                                                                      "rollout.temperature": 0.7}), timeout=300)
    assert bad.returncode == 2 and "rollout.temperature=1" in bad.stderr
