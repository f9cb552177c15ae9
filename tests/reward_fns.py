"""User reward functions for training tests (loaded by `reward.function=reward_fns:NAME`)."""


def digit_share(response: str, sample) -> dict:
    """Share of the response's characters that are digits: a random tiny policy earns a little of it, by chance,
    and different responses earn different amounts, so advantages are not all zero."""
    text = response or ""
    share = sum(c.isdigit() for c in text) / max(1, len(text))
    return {"overall": share, "digits": share}


def space_share(response: str, sample) -> dict:
    """Share of the response's characters that are spaces: a random tiny policy earns 10-20 % of it (many byte-level
    BPE tokens start with a space), so groups have spread and there is a direction to learn."""
    text = response or ""
    share = text.count(" ") / max(1, len(text))
    return {"overall": share, "spaces": share}
