"""The grouped forward's gradients on a CPU are the same in every run, on several threads.

The last prefix token predicts the first token of each of the G responses behind it, so the LM head's gather of
predictor rows names that row G times, and its backward adds the G gradients into one row. torch's backward of
`hidden[index]` on a CPU (`index_put_` with accumulate) adds them with atomic adds from all threads, in whatever order
the threads reach the row: two runs of the demo's GRPO stage with one seed parted by ~1e-7 within three steps and
sampled differently from there. The test compares the backward on 2 threads with the serial one
(`torch.use_deterministic_algorithms`) bit for bit, several times.
"""

from __future__ import annotations

import torch

from batches import completions, text_batch

REPEATS = 5  # before the fix 30 % of single backwards matched the serial order: all 5 by chance ~0.2 %


def test_grouped_backward_on_two_threads_equals_the_serial_one_bit_for_bit(load_tiny):
    from mmpg.grouping import grouped_logprobs

    model, tokenizer = load_tiny("qwen2")
    inputs = text_batch(tokenizer, 2)
    group_sizes = [8, 8]  # 16 responses of 30-45 tokens: ~600 predictor rows x hidden 64, past torch's parallel grain
    lengths = [30 + (3 * i) % 16 for i in range(16)]
    ids, mask = completions(group_sizes, lengths, model.config.vocab_size)

    def gradients(serial: bool) -> torch.Tensor:
        torch.use_deterministic_algorithms(serial)
        try:
            model.zero_grad(set_to_none=True)
            grouped_logprobs(model, inputs, ids, mask, group_sizes).sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the test workers run one thread each; the race needs two
    try:
        serial = gradients(serial=True)
        for attempt in range(REPEATS):
            parallel = gradients(serial=False)
            assert torch.equal(parallel, serial), (
                f"attempt {attempt}: max |difference| {(parallel - serial).abs().max().item():.3e} between the "
                f"2-thread and the serial backward")
    finally:
        torch.set_num_threads(threads)
