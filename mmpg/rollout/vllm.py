"""The vLLM engine: rollouts sampled by a vLLM server (`mmpg vllm-serve`) behind the `RolloutEngine` interface.

    engine = VLLMEngine(policy, processor, url="http://127.0.0.1:8000")
    rollout = engine.generate_groups(batch.inputs, 8, SamplingParams(...), prompt_seeds=seeds, videos=batch.videos)
    ... optimizer step ...
    engine.sync_weights()          # the policy's trainable tensors -> the server (every step)

This process never imports vllm (it runs in its own venv, `mmpg.serve`). Each prompt goes as the trainer's own token
ids with every video collapsed back to one `<|video_pad|>` (`mmpg.rollout.vllm_prompt`), plus the decoded frames and
their metadata, each distinct video of the batch once (`mmpg.serve.wire` version 2); vLLM expands the placeholder
again, and the prompt it ran must equal the trainer's token for token, else the request fails (`check_prompts`).
`n = G` in one request, so vLLM's prefix cache holds each prompt's K/V once for its G samples. `Rollout.logprobs`
are vLLM's raw logprobs (log softmax of the logits at temperature 1, before top-k / top-p: `mmpg.serve.vllm_server`),
so logprobs are asked only at temperature 1 or 0 (greedy); they differ from the trainer's recompute by the engines'
kernels (logged as actor/logprob_gap_*, corrected by `algos.truncated_is_weights` when rollout.tis_cap > 0).

Weight sync: the trainable tensors (LoRA adapters merged, W + scale B A, under the plain HF names) go as one
safetensors file (in /dev/shm when there) that the server's workers load, or by NCCL broadcast to GPU servers
started with --nccl (`mmpg.rollout.vllm_nccl`; a pool is one group, each tensor broadcast once); a restarted server
(new instance id) gets every tensor; under ZeRO-3 every rank gathers the tensors with the others and rank 0 sends
them. docs/rollouts.md, "vLLM rollouts", has the details (`last_stats` too).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence

import torch

from mmpg import choices, dist
from mmpg.errors import UserError
from mmpg.models.lora_export import is_partitioned
from mmpg.rollout.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    Rollout,
    RolloutEngine,
    SamplingParams,
    group_sizes_for,
)
from mmpg.rollout.vllm_nccl import (SYNC_TIMEOUT_S, NCCLWeightSender, check_weight_path, local_gpu_facts,
                                     plan_pool_sync)
from mmpg.rollout.vllm_prompt import (
    check_prompts, distinct_videos, eos_ids, prompt_ids, rollout_stats, video_token_id, wire_collapser,
)
from mmpg.rollout.vllm_wait import wait_for_server
from mmpg.serve.wire import DEFAULT_URL, WIRE_VERSION, ServerError, call, check_wire, frames_array, pack

log = logging.getLogger("mmpg.rollout.vllm")

WEIGHT_FILE_PREFIX = "mmpg-weights-"  # + the writing process's PID + "-": a weight file (`_send_weights`)


def remove_stale_weight_files(folder: str, older_than_s: float = 600.0, now: float | None = None) -> list[str]:
    """Remove the weight files (`mmpg-weights-PID-*.safetensors`) that a trainer killed mid-sync left in `folder`:
    those whose PID is no process here and that are older than `older_than_s` (a sync in flight lasts at most
    rollout.vllm_sync_timeout_s). The `finally` of `_send_weights` removes its own file on an exception, not on a
    kill; in /dev/shm each left-over file holds its size of RAM until the machine restarts. Returns the removed
    paths (logged)."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(WEIGHT_FILE_PREFIX) and name.endswith(".safetensors")):
            continue
        pid = name[len(WEIGHT_FILE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime < older_than_s:
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    if removed:
        log.warning("removed %d weight file(s) that stopped syncs left behind: %s", len(removed), ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


class PromptTooLongError(ValueError):
    """A prompt plus max_new_tokens exceeds the server's max_model_len; `index` is the prompt (0..B-1)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def pool_urls(url: str) -> list[str]:
    """rollout.vllm_url: one server's URL, or a pool's, comma-separated; a UserError (one line) when it names none."""
    urls = [u.strip() for u in str(url).split(",") if u.strip()]
    if not urls:
        raise UserError(f"rollout.vllm_url={url!r} names no server; give http://HOST:PORT (a pool: comma-separated)")
    return urls


class VLLMEngine(RolloutEngine):
    """Samples with a vLLM server. model: the trainer's policy (stop / pad ids, placeholder ids, weights to sync);
    processor: decodes the responses. wait_s: how long the constructor waits for the server to come up."""

    def __init__(self, model, processor, url: str = DEFAULT_URL, timeout_s: float = 600.0, wait_s: float = 0.0,
                 sync_timeout_s: float = SYNC_TIMEOUT_S):
        from mmpg.grouping.inputs import placeholder_token_ids

        # a pool of servers ("URL,URL,..."): the ranks holding different samples use them in turn, rank r server
        # r mod N, so each rank's requests go to one server (its videos' caches there) and the pool decodes in parallel
        self.urls = pool_urls(url)
        index = dist.data_rank() % len(self.urls)
        self.model, self.processor, self.url, self.timeout_s = model, processor, self.urls[index], float(timeout_s)
        self.sync_timeout_s = float(sync_timeout_s)  # one weight sync, NCCL rendezvous included
        self.banned = [int(t) for t in placeholder_token_ids(model)]  # never sampled (HFEngine bans them too)
        self.health = wait_for_server(self.url, wait_s, index=index) if wait_s > 0 else self._health()
        check_wire(self.health, self.url)
        check_weight_path(self.health, self.url)  # a server on another machine: weights by NCCL only
        self.pool_health = {self.url: self.health}  # rank 0 (the sender): every server's, in the pool's order
        if dist.rank() == 0:  # the sender: every server of the pool up, and reachable by the weight file
            for i, other in enumerate(self.urls):
                if other != self.url:
                    health = wait_for_server(other, wait_s, index=i) if wait_s > 0 else call(
                        other, "/health", timeout=min(self.timeout_s, 30.0), what="a health check")
                    check_wire(health, other)
                    check_weight_path(health, other)
                    self.pool_health[other] = health
            self.pool_health = {u: self.pool_health[u] for u in self.urls}
        self.version = int(self.health["version"])  # weight version the server holds (0: its checkpoint)
        self.last_sync: dict = {}
        self.last_stats: dict | None = None  # what the last generate_groups prefilled (`rollout_stats`)
        self._senders: dict = {}  # NCCL senders by the URLs they reach (GPU servers with --nccl), made on first use
        self._plans: dict = {}  # how weights reach those URLs (`vllm_nccl.plan_pool_sync`), decided on first sync
        self._device: torch.device | None = None  # where the synced tensors live (the NCCL sender's device)
        self.partitioned = is_partitioned(model)  # ZeRO-3: the weight sync is a collective of every rank
        self.samples_with_policy = False  # the server holds its own copy of the weights: `sync_weights` after updates
        self.resync_on_restart = True  # a restarted server gets every weight again (False: an error, see GRPOStep)

    # ---- sampling -----------------------------------------------------------------------------------------------
    def generate_groups(self, prompt_inputs, group_size: int | Sequence[int], sampling: SamplingParams | None = None,
                        *, prompt_seeds: Sequence[int] | None = None, videos: Sequence | None = None) -> Rollout:
        """As `HFEngine.generate_groups`; `videos`: the B prompts' decoded videos (`DecodedVideo`, or (frames
        [T, C, H, W], metadata) pairs, None for a text-only prompt; a list of them for a prompt holding several, in
        order: a multi-turn conversation's overview and clips), required when the prompts hold a video: the server
        gets the frames themselves, not the trainer's patches (a ValueError naming the prompt without them).
        Seeds: row j of prompt b comes from the server's generator for (prompt_seeds[b] or sampling.seed + b), so it
        does not depend on the other prompts of the batch. A prompt longer than `max_model_len` - max_new_tokens
        raises `PromptTooLongError`, an unreachable or refusing server a `ServerError` (`user_error` words both)."""
        sampling = sampling or SamplingParams()
        if sampling.logprobs and sampling.temperature not in (0, 1):
            raise ValueError(f"VLLMEngine returns vLLM's raw logprobs (temperature 1); temperature "
                             f"{sampling.temperature} would make them another distribution's: use 1 (or 0, greedy), "
                             "or SamplingParams(logprobs=False)")
        ids = prompt_ids(prompt_inputs)
        sizes = group_sizes_for(group_size, len(ids))
        if prompt_seeds is not None and len(prompt_seeds) != len(sizes):
            raise ValueError(f"{len(prompt_seeds)} prompt seeds for {len(sizes)} prompts; give one per prompt")
        seeds = list(prompt_seeds) if prompt_seeds is not None else [sampling.seed + b for b in range(len(sizes))]
        limit = self.max_model_len
        for b, p in enumerate(ids):
            if len(p) + sampling.max_new_tokens > limit:
                raise PromptTooLongError(b, f"prompt {b} has {len(p)} tokens; with max_new_tokens="
                                            f"{sampling.max_new_tokens} that exceeds the vLLM server's max_model_len "
                                            f"{limit}: restart it with a larger --max-model-len, or use fewer frames")
        meta, arrays = self._request(ids, sizes, seeds, sampling, prompt_inputs, videos)
        body = pack(meta, arrays)
        try:
            answer = call(self.url, "/generate", body=body, timeout=self.timeout_s, what="a rollout request")
        except ServerError as e:
            if e.status != 409:  # 409: a restarted server (new instance id), see mmpg.serve.vllm_server
                raise
            if not self.resync_on_restart:
                raise ServerError(f"the vLLM server at {self.url} restarted while rollouts overlap the update "
                                  "(rollout.max_staleness > 0): the weights to resend are not settled mid-update; "
                                  "resume the run (--resume auto)") from None
            if self.partitioned:  # the ranks' requests meet the restart at different times: no common gather
                raise ServerError(f"the vLLM server at {self.url} restarted and serves its checkpoint again; under "
                                  "ZeRO-3 the ranks gather the weights together and cannot resend them from one "
                                  "rank's request: resume the run (--resume auto)") from None
            self._forget_server()
            log.warning("the vLLM server at %s restarted; sending it every weight again", self.url)
            self._send_weights(everything=True)
            meta["expect"] = {"instance": self.health["instance"], "version": self.version}
            body = pack(meta, arrays)
            answer = call(self.url, "/generate", body=body, timeout=self.timeout_s, what="a rollout request")
        check_prompts(answer.get("prompt_token_ids"), ids)
        # each prompt's first video (its overview) says which prompts share a prefix
        self.last_stats = rollout_stats(ids, [p["videos"][0] if p["videos"] else None for p in meta["prompts"]],
                                        answer, len(body))
        return self._rollout(answer["outputs"], sizes, sampling)

    def _request(self, ids, sizes, seeds, sampling: SamplingParams, prompt_inputs, videos) -> tuple[dict, dict]:
        """The request's JSON part and its frames: each distinct video once (wire 2), a prompt's videos in order
        (wire 3: a multi-turn conversation holds the overview and its clips)."""
        video_token = video_token_id(self.model)
        # vLLM expands a video's placeholder itself (from the frames): each video goes as one video token
        collapse = wire_collapser(self.model, self.processor)
        wire_ids = [collapse(p) for p in ids]
        per_prompt = []  # [B] each prompt's videos, in the order of its video tokens
        for b, w in enumerate(wire_ids):
            count = 0 if video_token is None else sum(1 for t in w if t == video_token)
            given = videos[b] if videos is not None and b < len(videos) else None
            items = [] if given is None else list(given) if isinstance(given, list) else [given]
            if count and not items:
                raise ValueError(f"prompt {b} holds a video but no frames were given; VLLMEngine needs the "
                                 "decoded videos: generate_groups(..., videos=batch.videos)")
            if count != len(items) and count:
                raise ValueError(f"prompt {b} holds {count} videos and {len(items)} were given; give a prompt's "
                                 "videos in order as a list (the overview, then its clips)")
            per_prompt.append(items if count else [])
        most = max((len(v) for v in per_prompt), default=0)
        limit = int(self.health.get("videos_per_prompt", 1))
        if most > limit:
            raise ServerError(f"a prompt holds {most} videos; the vLLM server at {self.url} takes {limit} per prompt: "
                              f"restart it with --videos-per-prompt {most}")
        table, index = distinct_videos([v for items in per_prompt for v in items])
        arrays = {f"video_{v}": frames_array(frames) for v, (frames, _) in enumerate(table)}
        picks, at = [], 0
        for items in per_prompt:
            picks.append([int(i) for i in index[at: at + len(items)]])
            at += len(items)
        prompts = [{"token_ids": w, "n": g, "seed": int(seed) % (2 ** 63), "videos": v}
                   for w, g, seed, v in zip(wire_ids, sizes, seeds, picks)]
        stop = list(sampling.stop_token_ids) if sampling.stop_token_ids is not None else eos_ids(self.model)
        meta = {"wire": WIRE_VERSION, "prompts": prompts, "client": dist.rank(),
                "videos": [{"key": f"video_{v}", "metadata": m} for v, (_, m) in enumerate(table)],
                "expect": {"instance": self.health["instance"], "version": self.version},
                "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                             "max_tokens": sampling.max_new_tokens, "stop_token_ids": stop, "banned": self.banned,
                             "logprobs": sampling.logprobs}}
        return meta, arrays

    def _rollout(self, outputs: list[list[dict]], sizes: list[int], sampling: SamplingParams) -> Rollout:
        from mmpg.grouping.inputs import pad_token_id

        rows = [o for per_prompt in outputs for o in per_prompt]
        if [len(o) for o in outputs] != sizes:
            raise ServerError(f"vLLM server returned {[len(o) for o in outputs]} responses per prompt, asked for "
                              f"{sizes}")
        width = max(len(r["token_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id(self.model), dtype=torch.long)  # [N, S]
        mask = torch.zeros(len(rows), width, dtype=torch.long)  # [N, S]
        logps = torch.zeros(len(rows), width, dtype=torch.float32)  # [N, S]
        for i, r in enumerate(rows):
            n = len(r["token_ids"])
            ids[i, :n], mask[i, :n] = torch.tensor(r["token_ids"], dtype=torch.long), 1
            if sampling.logprobs:
                logps[i, :n] = torch.tensor(r["logprobs"], dtype=torch.float32)
        return Rollout(completion_ids=ids, completion_mask=mask, group_sizes=list(sizes),
                       texts=self.processor.batch_decode([r["token_ids"] for r in rows], skip_special_tokens=True),
                       finish_reasons=[FINISH_STOP if r["finish_reason"] == "stop" else FINISH_LENGTH for r in rows],
                       logprobs=logps if sampling.logprobs else None)

    # ---- what the trainer asks besides sampling (`RolloutEngine`) ----------------------------------------------
    @property
    def max_model_len(self) -> int:
        """Prompt + response tokens the server holds (its --max-model-len; a restarted server's own)."""
        return int(self.health["max_model_len"])

    def overlap_updates(self) -> None:
        """Rollouts overlap the update: a server that restarts mid-run is an error, not resynced (the policy is
        mid-update, not the weights to resend)."""
        self.resync_on_restart = False

    def user_error(self, error: Exception, prompts: Sequence[str] | None = None) -> str | None:
        """A `ServerError` (no server, a timeout, a refusal) or a `PromptTooLongError`, the latter under the name of
        its prompt (`prompts[error.index]`, e.g. the sample's file:line)."""
        if isinstance(error, PromptTooLongError) and prompts is not None:
            return f"{prompts[error.index]}: {error}".replace(f"prompt {error.index} has", "the prompt has")
        return str(error) if isinstance(error, (ServerError, PromptTooLongError)) else None

    # ---- weights ------------------------------------------------------------------------------------------------
    def sync_weights(self, everything: bool = False) -> dict:
        """After an update, on every rank: rank 0 sends the policy's trainable tensors to every server of the pool
        (under ZeRO-3 every rank gathers them with it, `_send_weights`); the others return {}. One process: it
        sends."""
        if not self.partitioned and dist.rank() != 0:
            return {}
        return self._send_weights(everything, self.urls)

    def _send_weights(self, everything: bool = False, urls: Sequence[str] | None = None) -> dict:
        """Send the policy's trainable tensors (every tensor with `everything`) to the servers `urls` (default: this
        rank's own); returns {"tensors", "bytes", "seconds", "server_seconds"} (the slowest server's). The file lives
        in /dev/shm when there (no disk I/O) and is written once for every server of the pool (one machine).
        A LoRA policy sends its adapted modules with the adapters merged, under the plain model's names
        (`mmpg.models.lora_export.sync_tensors`): the server serves the plain base model.

        Under ZeRO-3 (`self.partitioned`) it is a collective: every rank calls it, the ranks gather the parameters
        together a bounded piece at a time (`gathered_sync_tensors`), rank 0 keeps a copy of each (on the CPU for
        the file, on its GPU for NCCL) and sends them; the other ranks return {}. Without ZeRO-3 one rank calls it."""
        t0 = time.perf_counter()
        from mmpg.models.lora_export import gathered_sync_tensors, sync_tensors

        if self.partitioned:
            rank0 = dist.rank() == 0
            device = next(self.model.parameters()).device
            nccl, refused = False, None
            if rank0:  # a refused plan is raised after the gather, which every rank must enter alike
                try:
                    nccl = self._sync_plan(device, urls or [self.url]).kind == "nccl"
                except ServerError as e:
                    refused = e
            params = gathered_sync_tensors(self.model, everything, keep=rank0 and refused is None,
                                           device=device if nccl else "cpu")
            if refused is not None:
                raise refused
            if not rank0:
                return {}
        else:
            with torch.no_grad():
                params = sync_tensors(self.model, everything=everything)
        if not params:
            return {"tensors": 0, "bytes": 0, "seconds": 0.0, "server_seconds": 0.0}
        urls = list(urls or [self.url])
        plan = self._sync_plan(next(iter(params.values())).device, urls)
        if plan.kind == "nccl":  # GPU: vLLM's NCCL transfer, one broadcast per tensor for the whole pool
            answers = self._nccl(plan).send(params, self.version + 1)
            return self._synced(params, self._one_version(urls, answers), t0)
        from safetensors.torch import save_file

        tensors = {n: p.to("cpu").contiguous() for n, p in params.items()}
        folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        remove_stale_weight_files(folder or tempfile.gettempdir(), older_than_s=max(600.0, self.sync_timeout_s))
        fd, path = tempfile.mkstemp(prefix=f"{WEIGHT_FILE_PREFIX}{os.getpid()}-", suffix=".safetensors", dir=folder)
        os.close(fd)
        try:
            save_file(tensors, path)
            answers = self._update_all(urls, path)
        finally:
            os.unlink(path)
        return self._synced(tensors, self._one_version(urls, answers), t0)

    @staticmethod
    def _one_version(urls: list[str], answers: list[dict]) -> dict:
        """The slowest server's answer, once every server of the pool holds the same weight version."""
        versions = {u: int(a["version"]) for u, a in zip(urls, answers)}
        if len(set(versions.values())) > 1:
            raise ServerError(f"the vLLM servers hold different weight versions after a sync: {versions}; restart "
                              "them and resume the run (--resume auto)")
        return max(answers, key=lambda a: float(a["seconds"]))

    def _update_all(self, urls: list[str], path: str) -> list[dict]:
        """POST the weight file to every server in `urls` at once; their answers in order (the first error raised)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(url: str) -> dict:
            return call(url, "/update_weights", payload={"path": path, "version": self.version + 1},
                        timeout=self.sync_timeout_s, what="a weight update", setting="rollout.vllm_sync_timeout_s")

        if len(urls) == 1:
            return [one(urls[0])]
        with ThreadPoolExecutor(len(urls)) as pool:
            return list(pool.map(one, urls))

    def _synced(self, tensors: dict, answer: dict, t0: float) -> dict:
        self.version = int(answer["version"])
        self.last_sync = {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                          "seconds": time.perf_counter() - t0, "server_seconds": float(answer["seconds"])}
        return self.last_sync

    def _sync_plan(self, device: torch.device, urls: Sequence[str]):
        """How weights reach the servers `urls` (`vllm_nccl.plan_pool_sync`), decided once per set of servers and
        recorded as the "weight_sync" choice (`mmpg.choices`); a step down to the file is one warning."""
        key = tuple(urls)
        if key not in self._plans:
            gpu, version = local_gpu_facts(device)
            healths = {u: self.pool_health.get(u) or self.health for u in urls}
            plan = self._plans[key] = plan_pool_sync(healths, device.type == "cuda", gpu, version)
            self._device = device
            nccl = any(h.get("nccl") for h in healths.values())
            if plan.kind == "file" and nccl:
                log.warning("vLLM weight sync by file, not NCCL: %s", plan.why)
            choices.record("weight_sync", plan.kind, plan.why if nccl else "")
        return self._plans[key]

    def _nccl(self, plan):
        """The NCCL sender to the plan's servers (one group for a pool), made once."""
        key = tuple(u for u, _ in plan.servers)
        if key not in self._senders:
            self._senders[key] = NCCLWeightSender(plan.servers, timeout_s=self.sync_timeout_s, device=self._device)
        return self._senders[key]

    def _forget_server(self) -> None:
        """After this rank's server restarted: its new /health, and every plan and NCCL group that held it. A server
        of a pool synced by NCCL cannot rejoin the pool's group from here (rank 0 owns it): an error, resume."""
        pooled = False
        if len(self.urls) > 1 and self.health.get("nccl"):
            plan = self._plans.get(tuple(self.urls))  # the sender's (rank 0), decided at its first sync
            if plan is None:  # another rank: the same rule on what it knows
                device = self._device or next(self.model.parameters()).device  # where the synced tensors live
                healths = {u: self.pool_health.get(u, self.health) for u in self.urls}
                plan = plan_pool_sync(healths, device.type == "cuda", *local_gpu_facts(device))
            pooled = plan.kind == "nccl"
        if pooled:
            raise ServerError(f"the vLLM server at {self.url} restarted and serves its checkpoint again; the pool's "
                              "NCCL group lost its workers and is rebuilt only at a start: resume the run "
                              "(--resume auto)")
        self.health = self._health()
        self.pool_health[self.url] = self.health
        for key in [k for k in self._plans if self.url in k]:
            self._plans.pop(key)
            self._senders.pop(key, None)

    def _health(self) -> dict:
        health = call(self.url, "/health", timeout=min(self.timeout_s, 30.0), what="a health check")
        check_wire(health, self.url)
        return health
