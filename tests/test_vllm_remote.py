"""A vLLM server on a node of its own: the shared token (mmpg.serve.auth) enforced by the server's real HTTP layer
(`vllm_server.make_handler` around a stand-in engine; no vLLM needed) and sent by the trainer's client from
$MMPG_VLLM_TOKEN; a server bound beyond 127.0.0.1 without one refused; a server on another machine that could only
get its weights by file refused before the first step; and scripts/train_grounding.sh's VLLM_URL (no server started
here, the trainer pointed at it) and VLLM=serve (only the server, bound where VLLM_HOST says)."""

from __future__ import annotations

import os
import subprocess
import threading
import sys
import time
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from mmpg.rollout.vllm_nccl import check_weight_path
from mmpg.rollout.vllm_wait import wait_for_server
from mmpg.serve import vllm_server
from mmpg.serve.wire import WIRE_VERSION, ServerError, call

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "0f3c9a7e5b1d"


class Engine:
    """The Backend's surface the handler calls; what came in is kept."""

    def __init__(self):
        self.generated = []

    def health(self):
        return {"instance": "i", "version": 0, "max_model_len": 4096, "wire": WIRE_VERSION}

    def generate(self, blob):
        self.generated.append(len(blob))
        return {"outputs": [], "bytes": len(blob)}

    update_weights = init_weight_transfer = update_weights_nccl = generate


@pytest.fixture
def served():
    """(url, engine) of the server's HTTP layer on a free port with the token TOKEN."""
    engine = Engine()
    server = ThreadingHTTPServer(("127.0.0.1", 0), vllm_server.make_handler(engine, TOKEN))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", engine
    server.shutdown()
    server.server_close()


def test_requests_without_the_token_get_401_and_reach_nothing(served, monkeypatch):
    url, engine = served
    monkeypatch.delenv("MMPG_VLLM_TOKEN", raising=False)
    with pytest.raises(ServerError) as err:
        call(url, "/health", timeout=10)
    assert err.value.status == 401
    assert "needs its shared token and the client sent none: set MMPG_VLLM_TOKEN" in str(err.value)
    monkeypatch.setenv("MMPG_VLLM_TOKEN", "not-it")
    with pytest.raises(ServerError, match="HTTP 401.*the client sent another"):
        call(url, "/generate", body=b"x" * (3 << 20), timeout=10)  # a large body: the 401, not a reset connection
    assert engine.generated == []
    request = urllib.request.Request(url + "/health", headers={"Authorization": TOKEN})  # no "Bearer"
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=10)
    assert raw.value.code == 401


def test_the_client_sends_the_token_from_its_environment(served, monkeypatch):
    url, engine = served
    monkeypatch.setenv("MMPG_VLLM_TOKEN", TOKEN)
    assert call(url, "/health", timeout=10)["max_model_len"] == 4096
    assert call(url, "/generate", body=b"y" * 1000, timeout=10)["bytes"] == 1000
    assert engine.generated == [1000]


def test_the_trainers_wait_ends_at_a_401(served, monkeypatch):
    """Waiting rollout.vllm_wait_s (300 s by default) for a server that is up but refuses this client's token would
    only delay the same error."""
    url, _ = served
    monkeypatch.delenv("MMPG_VLLM_TOKEN", raising=False)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="HTTP 401"):
        wait_for_server(url, wait_s=60, poll_s=0.5)
    assert time.monotonic() - t0 < 10


def test_a_server_beyond_loopback_needs_a_token(monkeypatch, capsys):
    monkeypatch.delenv("MMPG_VLLM_TOKEN", raising=False)
    for host in ("0.0.0.0", "node3", ""):
        assert vllm_server.main(["--checkpoint", "/nowhere", "--host", host]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("mmpg vllm-serve: error: --host ") and "give the server a shared token" in line
    # with a token (or on 127.0.0.1) it goes on, to the next thing it checks: here the missing checkpoint
    for argv, env in ((["--host", "0.0.0.0", "--token", TOKEN], {}),
                      (["--host", "0.0.0.0"], {"MMPG_VLLM_TOKEN": TOKEN}), (["--host", "127.0.0.1"], {})):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert vllm_server.main(["--checkpoint", "/nowhere", *argv]) == 2
        assert "no checkpoint folder at /nowhere" in capsys.readouterr().err


def test_a_server_on_another_machine_needs_the_nccl_weight_sync():
    import socket

    here = socket.gethostname()
    check_weight_path({"host": here, "nccl": False}, "http://127.0.0.1:8000")  # this machine: the file is fine
    check_weight_path({"host": "node3", "nccl": True}, "http://node3:8000")  # NCCL crosses machines
    check_weight_path({}, "http://node3:8000")  # an older server does not say: left to the first sync
    with pytest.raises(ServerError, match="runs on node3, this trainer on .* started without --nccl"):
        check_weight_path({"host": "node3", "nccl": False}, "http://node3:8000")


def _launch(tmp_path, **env):
    """scripts/train_grounding.sh with stand-ins for env.sh, DeepSpeed and the server: (process, trainer, server)."""
    for name in ("deepspeed", "serve"):
        (tmp_path / name).write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/{name}.args\n')
        (tmp_path / name).chmod(0o755)
    (tmp_path / "pdsh").write_text("#!/bin/sh\n")
    (tmp_path / "pdsh").chmod(0o755)
    drop = ("VLLM", "VLLM_URL", "VLLM_GPUS", "VLLM_ARGS", "VLLM_HOST", "VLLM_PORT", "HOSTFILE", "NUM_GPUS", "LAUNCHER",
            "MMPG_VLLM_TOKEN", "DRY_RUN", "TRAIN_GPUS", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    e = {k: v for k, v in os.environ.items() if k not in drop}
    (tmp_path / "env.sh").write_text(f"MMPG_ROOT={ROOT}\nexport PATH={Path(sys.executable).parent}:$PATH\n")
    e.update(MMPG_ENV_SH=str(tmp_path / "env.sh"), MMPG_DEEPSPEED=str(tmp_path / "deepspeed"),
             MMPG_VLLM_SERVE=str(tmp_path / "serve"), PATH=f"{tmp_path}:{e['PATH']}", HOME=str(tmp_path),
             HF_HUB_OFFLINE="1", **env)
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "model.path=/models/q25"],
                         cwd=ROOT, env=e, capture_output=True, text=True, timeout=300, check=False)
    read = lambda name: (tmp_path / name).read_text().strip() if (tmp_path / name).exists() else None
    return res, read("deepspeed.args"), read("serve.args")


def test_vllm_url_starts_no_server_and_points_every_node_at_it(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=4\nnode2 slots=4\n")
    (tmp_path / ".deepspeed_env").write_text(f"MMPG_VLLM_TOKEN={TOKEN}\n")  # how pdsh hands it to node2
    res, trainer, server = _launch(tmp_path, VLLM="1", VLLM_URL="http://node3:8000", HOSTFILE=str(hostfile),
                                   MMPG_VLLM_TOKEN=TOKEN)
    assert res.returncode == 0, res.stderr
    assert server is None  # none started here
    assert trainer == (f"--hostfile {hostfile} --launcher pdsh --module mmpg.cli train --config configs/cpu_demo.yaml "
                       "model.path=/models/q25 rollout.engine=vllm rollout.vllm_url=http://node3:8000")
    assert TOKEN not in trainer  # the token travels in the environment, never on a command line


@pytest.mark.parametrize("env, message", [
    ({"VLLM": "1", "VLLM_URL": "http://node3:8000", "VLLM_GPUS": "7"}, "VLLM_GPUS set(s) up one this script starts"),
    ({"VLLM_URL": "http://node3:8000"}, "VLLM_URL is the server of VLLM=1: set VLLM=1 too"),
    ({"VLLM": "2"}, "VLLM=2: use 1 (rollouts by vLLM) or serve (start only its server)"),
])
def test_vllm_url_refusals(tmp_path, env, message):
    res, trainer, server = _launch(tmp_path, **env)
    assert res.returncode == 2 and message in res.stderr and trainer is None and server is None


def test_vllm_serve_starts_only_the_server_where_vllm_host_says(tmp_path):
    res, trainer, server = _launch(tmp_path, VLLM="serve", VLLM_HOST="node3", VLLM_PORT="8100", VLLM_MAX_LEN="4096",
                                   VLLM_ARGS="--nccl")
    assert res.returncode == 0, res.stderr
    assert trainer is None
    assert server == "--checkpoint /models/q25 --host node3 --port 8100 --max-model-len 4096 --nccl"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_started_apart_with_a_token_serves_a_trainer_pointed_at_it(grpo_data, tmp_path_factory, tmp_path):
    """The two halves of a server on its own node, on one machine: `VLLM=serve` starts the real `mmpg vllm-serve`
    (.venv-vllm) with a token, `VLLM=1 VLLM_URL=...` trains 2 GRPO steps against it (rollouts and weight syncs carry
    the token); the same server refuses a client without it."""
    import signal

    from train_utils import env as cli_env
    from train_utils import metrics, overrides
    from vllm_server import tiny_vllm_checkpoint

    from mmpg.serve.launch import free_port

    ckpt = tiny_vllm_checkpoint("qwen2_5_vl", tmp_path_factory)  # skips without .venv-vllm
    port = free_port()
    data = {"model": str(ckpt), "synth": grpo_data["synth"]}
    args = ["configs/cpu_demo.yaml"] + overrides(data, tmp_path, "apart", **{
        "data.batch_size": 4, "data.fps": 0.5, "data.min_frames": 2, "data.max_frames": 2, "data.shuffle": False,
        "data.val": "", "eval.every_n_steps": 0, "trainer.total_steps": 2, "rollout.max_new_tokens": 8,
        "rollout.temperature": 1.0, "rollout.vllm_wait_s": 900})
    env = dict(cli_env(), MMPG_EXTRAS="dev", MMPG_VLLM_TOKEN=TOKEN, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_URL", None)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "scripts/train_grounding.sh", *args], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env=dict(env, VLLM="serve", VLLM_HOST="127.0.0.1", VLLM_PORT=str(port),
                                           VLLM_ARGS="--dtype float32 --enforce-eager"))
    url = f"http://127.0.0.1:{port}"
    try:
        trainer = subprocess.run(["bash", "scripts/train_grounding.sh", *args], cwd=ROOT, capture_output=True,
                                 text=True, timeout=1500, check=False,
                                 env=dict(env, VLLM="1", VLLM_URL=url, NUM_GPUS="1", MASTER_PORT=str(free_port())))
        assert trainer.returncode == 0, (trainer.stdout + trainer.stderr)[-3000:] + "\n" + log.read_text()[-2000:]
        assert [r["step"] for r in metrics(tmp_path / "apart") if "timing_s/weight_sync" in r] == [1, 2]
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("MMPG_VLLM_TOKEN", raising=False)
            with pytest.raises(ServerError, match="HTTP 401"):
                call(url, "/health", timeout=30)
            mp.setenv("MMPG_VLLM_TOKEN", TOKEN)
            assert call(url, "/health", timeout=30)["version"] >= 2  # the trainer's weight syncs reached it
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    assert "requests need the shared token" in log.read_text()
