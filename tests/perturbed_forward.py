"""A grouped forward made wrong on purpose, for the self-check's end-to-end test: importing this module (through
`reward.function=perturbed_forward:digit_share`, which a training run imports at start) shifts every response's
positions in the packed row by one, so each response is scored as if it sat one token later. The repeated forward is
untouched, so the two disagree as a real layout bug would make them."""

import mmpg.grouping.logprobs as logprobs
import mmpg.grouping.shares as shares
from reward_fns import digit_share  # noqa: F401  (the reward the run uses)

_pack = shares.pack_shares


def _shifted_pack(prefixes, completions, shares, device, **options):
    ids, pos, *rest = _pack(prefixes, completions, shares, device, **options)
    shifted = pos.clone()
    shifted[:, shares[0].length:] += 8  # everything after the first prefix
    return (ids, shifted, *rest)


logprobs.pack = _shifted_pack
