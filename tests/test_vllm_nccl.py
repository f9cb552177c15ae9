"""The NCCL weight sync's failure paths on the CPU: the server's real HTTP routes (`mmpg.serve.vllm_server`'s handler
around a stand-in engine) refusing or never answering, a stand-in NCCL whose peer never joins or never receives, and
the CUDA facts the sender asks for (device, UUID, NCCL version) stubbed. Every wait must end within its deadline or at
once on a refusal, with one line naming the server; a refusal on rank 0 must reach every rank.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from mmpg import choices
from mmpg.rollout.vllm_nccl import NCCLWeightSender, SyncPlan, nccl_version, plan_weight_sync
from mmpg.serve.wire import ServerError, call

TRAINER_GPU, SERVER_GPU = "GPU-trainer-0000", "GPU-server-0001"
PROMPT_S = 10.0  # a refusal must end the wait well before this (the deadlines in these tests are 60 s)


class FakeNCCL:
    """torch.cuda.nccl with a peer: it joins the rendezvous (or never does) and receives broadcasts (or never
    does). A call that never returns waits on `release` (set at teardown)."""

    def __init__(self):
        self.joins, self.receives = True, True
        self.worlds, self.sent, self.release = [], [], threading.Event()

    def unique_id(self):
        return bytes(128)

    def init_rank(self, world, uid, rank):
        self.worlds.append(world)
        if not self.joins:
            self.release.wait()
        return "comm"

    def all_reduce(self, tensors, comms=None, **_):
        pass

    def broadcast(self, tensors, root=0, streams=None, comms=None):
        if not self.receives:
            self.release.wait()
        self.sent.append(tensors[0].clone())


@pytest.fixture
def nccl(monkeypatch):
    """A stand-in NCCL and the CUDA facts of a trainer on GPU 0 (tensors stay on the CPU)."""
    fake = FakeNCCL()
    for name in ("unique_id", "init_rank", "all_reduce", "broadcast"):
        monkeypatch.setattr(torch.cuda.nccl, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(uuid=TRAINER_GPU))
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: zeros(*a, **k))  # "cuda" stays on the CPU
    yield fake
    fake.release.set()


class StubLLM:
    """vllm.LLM as the server's NCCL routes use it. refuse: the method that raises (the workers' NCCL failing);
    hang: the method that never returns (ignoring its timeout, as a stuck worker would)."""

    def __init__(self, fake: FakeNCCL, workers: int, refuse: str = "", hang: str = ""):
        self.fake, self.workers, self.refuse, self.hang = fake, workers, refuse, hang
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: None)
        self.calls = []  # (method, args) as the workers got them

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        if method == self.refuse:
            raise RuntimeError(f"NCCL error in {method}: invalid usage")
        if method == self.hang:
            self.fake.release.wait()
        return [None] * self.workers

    def reset_prefix_cache(self):
        pass


def _server(fake, workers=1, gpus=(SERVER_GPU,), nccl_ver="2.21.5", **stub):
    """The real /health, /init_weight_transfer and /update_weights_nccl routes around a stand-in engine."""
    from mmpg.serve.engine_loop import EngineLoop
    from mmpg.serve.nccl import worker_facts
    from mmpg.serve.vllm_server import Backend, make_handler

    backend = Backend.__new__(Backend)
    backend.loop = EngineLoop(lambda: StubLLM(fake, workers, **stub), lambda llm: {}, lambda: backend.version)
    backend.instance, backend.version, backend.max_model_len, backend.checkpoint = "i0", 0, 1024, "/ckpt"
    backend.device, backend.nccl, backend.videos_per_prompt = "cuda", True, 1
    backend.workers = worker_facts([{"device": f"cuda:{i}", "gpu": g, "nccl": nccl_ver} for i, g in enumerate(gpus)])
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(backend))
    httpd.backend = backend
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture
def serve(nccl):
    started = []

    def start(**kw):
        httpd, url = _server(nccl, **kw)
        started.append(httpd)
        return url

    yield start
    for httpd in started:
        httpd.shutdown()


@pytest.fixture
def silent_url():
    """A port that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _within(seconds: float, fn):
    """(fn's result or exception, seconds taken); fails the test if fn still blocks after `seconds`."""
    box, done = {}, threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["value"] = e
        done.set()

    t0 = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    if not done.wait(seconds):
        pytest.fail(f"still blocked after {seconds:g} s")
    return box["value"], time.monotonic() - t0


def _one_line_error(value, *words):
    assert isinstance(value, ServerError), f"expected a ServerError, got {value!r}"
    text = str(value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, f"{w!r} not in: {text}"
    return text


def test_setup_refused_by_the_server_ends_at_once(serve, nccl):
    nccl.joins = False  # the server's workers fail, so the peer never joins
    url = serve(refuse="init_weight_transfer_engine")
    err, took = _within(PROMPT_S, lambda: NCCLWeightSender([(url, 1)], timeout_s=60))
    _one_line_error(err, url, "HTTP 500", "invalid usage", "restart")
    assert took < PROMPT_S


def test_setup_bounded_when_the_server_never_answers_and_no_peer_joins(silent_url, nccl):
    nccl.joins = False
    err, took = _within(PROMPT_S, lambda: NCCLWeightSender([(silent_url, 1)], timeout_s=1.0))
    _one_line_error(err, silent_url, "1 s", "rollout.vllm_sync_timeout_s")


def test_send_refused_ends_at_once_and_the_sender_stays_refused(serve, nccl):
    url = serve(refuse="start_weight_update")
    sender, _ = _within(PROMPT_S, lambda: NCCLWeightSender([(url, 1)], timeout_s=60))
    assert not isinstance(sender, BaseException), sender
    nccl.receives = False  # the workers never entered the broadcast
    err, took = _within(PROMPT_S, lambda: sender.send({"w": torch.ones(2)}, version=1))
    _one_line_error(err, url, "HTTP 500", "start_weight_update")
    again, took = _within(1.0, lambda: sender.send({"w": torch.ones(2)}, version=2))
    _one_line_error(again, url, "unusable")


def test_send_bounded_when_the_server_never_answers(serve, nccl):
    url = serve(hang="update_weights")
    sender, _ = _within(PROMPT_S, lambda: NCCLWeightSender([(url, 1)], timeout_s=1.0))
    assert not isinstance(sender, BaseException), sender
    nccl.receives = False
    err, _ = _within(PROMPT_S, lambda: sender.send({"w": torch.ones(2)}, version=1))
    _one_line_error(err, url, "1 s", "rollout.vllm_sync_timeout_s")


def test_world_is_one_plus_the_workers_the_server_reports(serve, nccl):
    url = serve(workers=2, gpus=(SERVER_GPU, "GPU-server-0002"))  # a tensor-parallel 2 server
    health = call(url, "/health", timeout=5)
    assert (health["workers"], health["worker_gpus"], health["nccl_version"]) == (2, [SERVER_GPU, "GPU-server-0002"],
                                                                                 "2.21.5")
    plan = plan_weight_sync(health, url, True, TRAINER_GPU, "2.21.5")
    assert plan == SyncPlan("nccl", 2, servers=[(url, 2)])
    sender, _ = _within(PROMPT_S, lambda: NCCLWeightSender(plan.servers, timeout_s=60))
    assert nccl.worlds == [3]
    named = {"a": torch.arange(3.0), "b": torch.ones(2, 2)}
    (answer,), _ = _within(PROMPT_S, lambda: sender.send(named, version=7))
    assert (answer["version"], answer["tensors"]) == (7, 2)
    assert [t.tolist() for t in nccl.sent] == [named["a"].tolist(), named["b"].tolist()]  # in the announced order


def test_colocated_server_gets_the_file_sync_with_one_warning(nccl, caplog):
    from mmpg.rollout.vllm import VLLMEngine

    health = {"nccl": True, "workers": 1, "worker_gpus": [TRAINER_GPU], "nccl_version": "2.21.5", "instance": "i0"}
    engine = _engine(["http://h:1"], [health])
    choices.reset()
    with caplog.at_level(logging.WARNING, logger="mmpg.rollout.vllm"):
        plan = engine._sync_plan(torch.device("cuda", 0), engine.urls)
    assert plan.kind == "file" and "one GPU" in plan.why
    same = plan_weight_sync(dict(health, worker_gpus=[TRAINER_GPU.upper().removeprefix("GPU-")]), "u", True,
                            TRAINER_GPU, "2.21.5")
    assert same.kind == "file"  # one GPU however its UUID is written
    assert [r.getMessage() for r in caplog.records if "by file" in r.getMessage()]
    assert choices.current()["weight_sync"]["value"] == "file"
    health["worker_gpus"] = [SERVER_GPU]
    engine._plans = {}
    assert engine._sync_plan(torch.device("cuda", 0), engine.urls).kind == "nccl"
    assert choices.current()["weight_sync"]["value"] == "nccl"
    choices.reset()


def _engine(urls: list[str], healths: list[dict]):
    """A VLLMEngine as rank 0 holds it after its start: the pool's URLs and /health answers, no plan yet."""
    from mmpg.rollout.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.urls, engine.url, engine.health = list(urls), urls[0], healths[0]
    engine.pool_health = dict(zip(urls, healths))
    engine._plans, engine._senders, engine._device, engine.sync_timeout_s = {}, {}, None, 60.0
    return engine


def test_a_pool_is_one_group_and_each_tensor_is_broadcast_once(nccl):
    """Two --nccl servers (tensor-parallel 2 and 1) on GPUs of their own: one group of 1 + 3 ranks, the first
    server's workers at ranks 1-2, the second's at 3; one broadcast per tensor reaches both, and both report the
    version. Before: the engine refused NCCL to a pool in one line."""
    from mmpg.rollout.vllm_nccl import plan_pool_sync

    a, url_a = _server(nccl, workers=2, gpus=(SERVER_GPU, "GPU-server-0002"))
    b, url_b = _server(nccl, workers=1, gpus=("GPU-server-0003",))
    try:
        healths = [call(u, "/health", timeout=5) for u in (url_a, url_b)]
        engine = _engine([url_a, url_b], healths)
        plan = engine._sync_plan(torch.device("cuda", 0), engine.urls)
        assert plan == plan_pool_sync(dict(zip(engine.urls, healths)), True, TRAINER_GPU, "2.21.5")
        assert (plan.kind, plan.workers, plan.servers) == ("nccl", 3, [(url_a, 2), (url_b, 1)])
        sender, _ = _within(PROMPT_S, lambda: engine._nccl(plan))
        assert not isinstance(sender, BaseException), sender
        assert engine._nccl(plan) is sender and nccl.worlds == [4]  # one group, made once
        named = {"a": torch.arange(3.0), "b": torch.ones(2, 2)}
        answers, _ = _within(PROMPT_S, lambda: sender.send(named, version=5))
        assert [(x["version"], x["tensors"]) for x in answers] == [(5, 2), (5, 2)]
        assert len(nccl.sent) == 2  # each tensor once, for both servers
        offsets = [[args[0]["rank_offset"] for m, args in httpd.backend.loop.llm.calls
                    if m == "init_weight_transfer_engine"] for httpd in (a, b)]
        worlds = [[args[0]["world_size"] for m, args in httpd.backend.loop.llm.calls
                   if m == "init_weight_transfer_engine"] for httpd in (a, b)]
        assert offsets == [[1], [3]] and worlds == [[4], [4]]
        assert [call(u, "/health", timeout=5)["version"] for u in (url_a, url_b)] == [5, 5]
    finally:
        a.shutdown()
        b.shutdown()


def test_a_mixed_pool_takes_the_file_on_this_machine_and_is_refused_across_machines(caplog):
    import socket as sock

    from mmpg.rollout.vllm_nccl import plan_pool_sync

    own = {"nccl": True, "workers": 1, "worker_gpus": [SERVER_GPU], "nccl_version": "2.21.5",
           "host": sock.gethostname()}
    colocated = dict(own, worker_gpus=[TRAINER_GPU])  # NCCL cannot reach it: two ranks on one GPU
    plan = plan_pool_sync({"http://a:1": own, "http://b:2": colocated}, True, TRAINER_GPU, "2.21.5")
    assert plan.kind == "file" and plan.why.startswith("1 of the pool's 2 servers take weights by file")
    assert plan_pool_sync({"http://a:1": dict(own, nccl=False), "http://b:2": dict(own, nccl=False)}, True,
                          TRAINER_GPU).kind == "file"
    with pytest.raises(ServerError) as err:
        plan_pool_sync({"http://a:1": dict(own, host="node7"), "http://b:2": colocated}, True, TRAINER_GPU, "2.21.5")
    _one_line_error(err.value, "http://a:1", "another machine", "start every server of the pool alike")


def test_a_restarted_server_of_an_nccl_pool_is_one_error_line(nccl):
    """Its workers left the pool's group, which only rank 0 can rebuild, at a start: resume (a pool synced by file
    resends the restarted server every weight instead)."""
    healths = [{"nccl": True, "workers": 1, "worker_gpus": [g], "nccl_version": "2.21.5", "instance": "i0"}
               for g in (SERVER_GPU, "GPU-server-0003")]
    engine = _engine(["http://a:1", "http://b:2"], healths)
    engine._device = torch.device("cuda", 0)
    with pytest.raises(ServerError) as err:
        engine._forget_server()
    _one_line_error(err.value, "http://a:1", "restarted", "--resume auto")


def test_nccl_versions_compared_at_the_handshake(caplog):
    health = {"nccl": True, "workers": 1, "worker_gpus": [SERVER_GPU], "nccl_version": "2.26.2"}
    with pytest.raises(ServerError) as err:
        plan_weight_sync(health, "http://h:1", True, TRAINER_GPU, "2.21.5")
    _one_line_error(err.value, "2.21.5", "2.26.2", "http://h:1", "--nccl")
    assert plan_weight_sync(dict(health, nccl_version="2.21.5"), "u", True, TRAINER_GPU, "2.21.5").kind == "nccl"
    with caplog.at_level(logging.WARNING, logger="mmpg.rollout.vllm"):
        assert plan_weight_sync(dict(health, nccl_version=None), "u", True, TRAINER_GPU, "2.21.5").kind == "nccl"
    assert any("unknown" in r.getMessage() for r in caplog.records)
    assert [nccl_version(v) for v in ((2, 30, 7), 23007, 2708, "2.21.5", None)] == ["2.30.7", "2.30.7", "2.7.8",
                                                                                      "2.21.5", None]


def test_plan_file_paths_and_an_older_server_refused():
    assert plan_weight_sync({"nccl": True, "workers": 1}, "u", False).kind == "file"  # CPU tensors
    assert plan_weight_sync({"nccl": False}, "u", True, TRAINER_GPU).kind == "file"  # server without --nccl
    with pytest.raises(ServerError, match="does not report its workers"):
        plan_weight_sync({"nccl": True}, "http://h:1", True, TRAINER_GPU)


def test_worker_facts_from_worker_info():
    from mmpg.serve.nccl import worker_facts, worker_info

    info = worker_info()  # this machine: no GPU visible to the test
    assert info == {"device": "cpu", "gpu": None, "nccl": None}
    assert worker_facts([info, info]) == {"workers": 2, "worker_gpus": [None, None], "nccl_version": None}


# ---- a refusal on rank 0 reaches every rank ----------------------------------------------------------------------
def _refused_engine():
    """An engine whose weight sync rank 0 sends and the server refuses (not ZeRO-3: the other ranks send nothing)."""
    from mmpg import dist
    from mmpg.rollout.engine import RolloutEngine

    class Refused(RolloutEngine):
        def generate_groups(self, prompt_inputs, group_size, sampling=None, *, prompt_seeds=None, videos=None):
            raise AssertionError("not sampled here")

        def sync_weights(self):
            if dist.rank() != 0:
                return {}
            raise ServerError("vLLM server at http://127.0.0.1:9 refused a weight update (HTTP 500): boom", 500)

        def user_error(self, error, prompts=None):
            return str(error) if isinstance(error, ServerError) else None

    return Refused()


def _rank_main(rank: int, init_file: str, results, leave):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                             timeout=datetime.timedelta(seconds=60))
    from mmpg.rl.grpo import GRPOStep

    step = GRPOStep.__new__(GRPOStep)
    step.device, step.rollout_engine = "cpu", _refused_engine()
    try:
        step.sync_weights()
        results.put((rank, "no error"))
    except Exception as e:  # noqa: BLE001
        results.put((rank, f"{type(e).__name__}: {e}"))
    leave.wait(60)  # rank 0 stays alive, as a process that has not exited yet


def test_a_refusal_on_rank_0_reaches_every_rank(tmp_path):
    # fresh processes: a forked one would inherit whatever process group an earlier test of this process left
    ctx = mp.get_context("spawn")
    results, leave = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "init"), results, leave)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + 120  # a spawned rank imports torch and the trainer first
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, text = results.get(timeout=1)
                got[rank] = text
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        leave.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
    assert sorted(got) == [0, 1], f"rank(s) {sorted({0, 1} - set(got))} still waiting: {got}"
    for text in got.values():
        assert text.startswith("UserError: vLLM server at http://127.0.0.1:9 refused a weight update"), got


def test_a_client_that_goes_away_costs_one_warning_and_the_server_keeps_serving(caplog, capfd):
    """A trainer killed (or timed out) while its request runs: the answer cannot be sent. That is one warning line,
    not an engine failure logged with its traceback, nor socketserver's traceback on stderr."""
    import http.client
    import struct

    from mmpg.serve.vllm_server import make_handler

    asked, answer = threading.Event(), threading.Event()

    def generate(body):
        asked.set()
        answer.wait(30)
        return {"outputs": []}

    backend = SimpleNamespace(health=lambda: {"ok": True}, generate=generate)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(backend))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        with caplog.at_level(logging.DEBUG, logger="mmpg.serve.vllm_server"):
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert asked.wait(10)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # gone at once (a reset), before the answer
            time.sleep(0.2)
            answer.set()
            for _ in range(100):
                if any("went away" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.05)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            health = conn.getresponse()
            assert health.status == 200  # still serving
            health.read()  # all of it: a socket closed with unread data resets, and the server's next read fails
            conn.close()
    finally:
        httpd.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == ["the client of POST /generate went away before its answer (200)"], lines
    assert "Traceback" not in capfd.readouterr().err
