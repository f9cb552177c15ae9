"""A grouped forward made wrong on purpose, for the self-check's end-to-end test: importing this module (through
`reward.function=perturbed_forward:digit_share`, which a training run imports at start) shifts every response's
positions in the packed row by one, so each response is scored as if it sat one token later. The repeated forward is
untouched, so the two disagree as a real layout bug would make them."""

import mmpg.grouping.adapters as adapters
import mmpg.grouping.logprobs as logprobs
from reward_fns import digit_share  # noqa: F401  (the reward the run uses)

_pack = adapters.pack


def _shifted_pack(prefixes, completions, device):
    ids, pos = _pack(prefixes, completions, device)
    shifted = pos.clone()
    shifted[:, prefixes.ids[0].numel():] += 8  # everything after the first prefix
    return ids, shifted


logprobs.pack = _shifted_pack
