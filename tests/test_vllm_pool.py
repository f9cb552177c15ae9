"""A pool of vLLM servers (`rollout.vllm_url=URL,URL`): rank r samples from server r mod N, rank 0 syncs the weights
to every server by one file. Two real CPU servers against one: a 2-rank GRPO run trains the same (seeded samples,
rewards, losses; final weights within WEIGHT_ATOL), both servers hold the same weight version after the run, and each
served its own rank's requests (/health's engine.requests)."""

from __future__ import annotations

import pytest
import torch
from vllm_server import Server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WEIGHT_ATOL = 1e-5  # final weights, float32, no TIS: the same samples give the same updates (measured: identical)
LOSS_ATOL = 1e-9  # per-step losses, a sum that cancels to ~1e-8 here (measured: identical)
# with TIS (the overlap needs it): behaviour logprobs ~1e-7 apart enter the loss, and Adam's normalised first steps
# turn that into ~1 % of the weights' movement (measured 2.3e-5 of 2.0e-3 after 2 steps at lr 1e-3)
WEIGHT_ATOL_TIS, LOSS_ATOL_TIS = 1e-4, 1e-6


@pytest.fixture(scope="module")
def second(vllm_ckpt, tmp_path_factory):
    """A second server of the same checkpoint, for this module only."""
    srv = Server(vllm_ckpt, tmp_path_factory.mktemp("vllm_pool") / "server.log")
    print(f"\nsecond vLLM server up in {srv.wait():.0f} s")
    yield srv
    srv.stop()


def _reset(*servers, checkpoint) -> None:
    """Every server back to the checkpoint's weights as version 0 (an in-place reload of every tensor)."""
    from mmpg.serve.wire import call

    for srv in servers:
        call(srv.url, "/update_weights", timeout=300, payload={"path": str(checkpoint / "model.safetensors"),
                                                               "version": 0})


def _health(srv) -> dict:
    from mmpg.serve.wire import call

    return call(srv.url, "/health", timeout=30)


@pytest.mark.parametrize("extra", [{}, {"rollout.max_staleness": 1}], ids=["synchronous", "overlapped"])
def test_two_ranks_on_two_servers_train_what_two_ranks_on_one_train(server, second, vllm_ckpt, tmp_path, extra):
    """Synchronous, and with the next step sampled while this one trains (k = 1: each rank's rollout thread on its
    own server, the weights sent to both only once no rollout that must not see them runs)."""
    from safetensors.torch import load_file
    from train_utils import metrics, overrides, run_cli

    from mmpg.toy.videos import generate_dataset

    generate_dataset(tmp_path / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    data = {"model": str(vllm_ckpt), "synth": tmp_path / "synth"}
    # synchronous: no TIS, so the update reads the engines' samples only: the runs must agree to the bit. k = 1 needs
    # TIS, whose weights read the engines' behaviour logprobs, which a server's other batch moves in the 7th digit
    tolerance = (WEIGHT_ATOL, LOSS_ATOL) if not extra else (WEIGHT_ATOL_TIS, LOSS_ATOL_TIS)
    extra = dict(extra, **({"rollout.tis_cap": 2.0} if extra else {}))
    base = {"rollout.engine": "vllm", "rollout.vllm_wait_s": 30, "data.min_frames": 2, "data.max_frames": 2,
            "trainer.total_steps": 2, "checkpoint.every_n_steps": 2, **extra}
    runs = {}
    for name, url in (("pool", f"{server.url},{second.url}"), ("one", server.url)):
        _reset(server, second, checkpoint=vllm_ckpt)
        served = [_health(s)["engine"]["requests"] for s in (server, second)]
        res = run_cli(["train"] + overrides(data, tmp_path / "runs", name, **base, **{"rollout.vllm_url": url}),
                      timeout=1200, procs=2)
        assert res.returncode == 0, res.stderr[-4000:]
        after = [_health(s) for s in (server, second)]
        runs[name] = {"metrics": metrics(tmp_path / "runs" / name),
                      "served": [h["engine"]["requests"] - n for h, n in zip(after, served)],
                      "versions": [h["version"] for h in after]}
    pool, one = runs["pool"], runs["one"]
    print(f"\nrequests served (first, second server): pool {pool['served']}, one server {one['served']}")
    synced = 3  # at start and after each of the 2 steps
    assert pool["versions"] == [synced, synced]
    assert one["versions"] == [synced, 0]  # the one-server run never touched the second
    assert pool["served"][0] > 0 and pool["served"][1] > 0 and one["served"][1] == 0  # rank 1 used its own
    assert len(pool["metrics"]) == len(one["metrics"]) == 2
    for a, b in zip(pool["metrics"], one["metrics"]):
        assert {k: v for k, v in a.items() if k.startswith("reward/")} == \
               {k: v for k, v in b.items() if k.startswith("reward/")}
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], rel=0, abs=tolerance[1])
        assert a["response/length_mean"] == b["response/length_mean"]  # the same samples
    weights = [load_file(tmp_path / "runs" / name / "checkpoints" / "step_00000002" / "model.safetensors")
               for name in ("pool", "one")]
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    start = load_file(vllm_ckpt / "model.safetensors")
    moved = max(float((weights[0][k] - start[k]).abs().max()) for k in start if k in weights[0])
    print(f"final weights: pool vs one server max |diff| {worst:.1e}; moved from the checkpoint {moved:.1e}")
    assert worst <= tolerance[0] < moved
    assert all(torch.isfinite(t).all() for t in weights[0].values())
