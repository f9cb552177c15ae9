"""The vLLM rollout server (`mmpg vllm-serve`) and the wire format it shares with its client.

vLLM pins its own torch and transformers, so it lives in its own venv (`.venv-vllm`, made by `scripts/env.sh vllm`)
and the trainer talks to it over HTTP on 127.0.0.1, as TRL's `trl vllm-serve` does (or on a node of its own, every
request carrying a shared token: `auth`):

    trainer (.venv)                                    server (.venv-vllm, vllm.LLM)
    mmpg.rollout.vllm.VLLMEngine  --POST /generate-->  token ids + each distinct video's frames once -> n = G
                                                       samples, token ids + logprobs, vLLM's cache counters
                                  --POST /update_weights (path of a safetensors file of changed tensors)-->
                                     collective_rpc: every worker loads them into its model; prefix cache reset
                                  --GET /health-->     instance id, weight version, max_model_len, checkpoint, wire

This package imports nothing of mmpg beyond itself, `mmpg.errors` and `mmpg.models.hub` (the standard library and
huggingface_hub only: the server resolves a hub id as the trainer does; the server's venv has mmpg installed without
dependencies), and `wire` imports no vllm, so the trainer can use it too.
"""
