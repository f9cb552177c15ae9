"""The rollout engine a config names (`rollout.engine`), built in one place so that a trainer holds a `RolloutEngine`
and never asks which one it is.

    hf    `HFEngine` on the policy itself (rollout.decode, cascade_backend, decode_check, prefill_chunk;
          algorithm.share_videos)
    vllm  `VLLMEngine`, a client of the server at rollout.vllm_url (waiting up to rollout.vllm_wait_s), which must hold
          the config's longest prompt and a whole response (`mmpg.rollout.lengths.check_server_len`; with the zoom
          tool the longest trajectory, and its videos per prompt: `check_server_videos`)

`mmpg.rollout.vllm` is imported here only when the config names it: an hf run never loads the vLLM client.
"""

from __future__ import annotations

from collections.abc import Callable

from mmpg.errors import UserError
from mmpg.rollout.engine import RolloutEngine


def make_rollout_engine(cfg, policy, processor, all_done: Callable[[bool], bool] | None = None) -> RolloutEngine:
    """cfg: the run's Config; policy: the trainer's model; processor: its processor. all_done(this_rank_done) ->
    whether every rank is done decoding (the HF engine's synced decoding under ZeRO-3; None: one process).
    Raises a UserError for a vLLM server that is not there, refuses, or is too short for the config."""
    rollout = cfg.rollout
    if rollout.engine == "vllm":
        from mmpg.rollout.lengths import (check_server_len, check_server_videos, response_tokens, response_words,
                                          worst_prompt)
        from mmpg.rollout.vllm import VLLMEngine
        from mmpg.serve.wire import ServerError

        try:
            engine = VLLMEngine(policy, processor, url=rollout.vllm_url, timeout_s=rollout.vllm_timeout_s,
                                wait_s=rollout.vllm_wait_s, sync_timeout_s=rollout.vllm_sync_timeout_s)
        except ServerError as e:  # no server, a late or refusing one: the message says what to do
            raise UserError(str(e)) from None
        check_server_len(engine.max_model_len, worst_prompt(cfg, processor), response_tokens(cfg, processor),
                         engine.url, response_words(cfg))
        check_server_videos(int(engine.health.get("videos_per_prompt", 1)), cfg, engine.url)
        return engine
    if rollout.engine != "hf":
        raise ValueError(f"rollout.engine={rollout.engine!r}; choose hf or vllm")
    from mmpg.rollout.hf import HFEngine

    return HFEngine(policy, processor, all_done=all_done, decode=rollout.decode,
                    cascade_backend=rollout.cascade_backend, decode_check=rollout.decode_check,
                    share_videos=cfg.algorithm.share_videos, prefill_chunk=rollout.prefill_chunk)
