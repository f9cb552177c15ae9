"""`mmpg train ARGV` in a forked process whose zoom tool is scripted (tests/test_zoom_grpo.py): the tiny models are
random and never write a call, so half the vocabulary stops a turn (as tests/test_zoom_rollout.py samples) and
every model turn that stopped is taken as a call whose window depends on the turn's text (one in three turns answers instead, one call in five asks past the video for an error turn), until
zoom.max_turns; about the first video it always answers at once. Everything else is the real path: the trajectories' tokens, clips, rewards, the trajectory tree,
the self-check and the update.
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    import zlib

    import dataclasses

    import mmpg.cli
    from mmpg.rollout import multiturn
    from mmpg.rollout.zoom import ZoomEnvironment, call_text

    real_sample = multiturn.sample_trajectories

    def sample_trajectories(engine, model, processor, inputs, samples, group_size, env, sampling, **kw):
        vocab = model.config.text_config.vocab_size
        sampling = dataclasses.replace(sampling, stop_token_ids=tuple(range(0, vocab, 2)))
        return real_sample(engine, model, processor, inputs, samples, group_size, env, sampling, **kw)

    multiturn.sample_trajectories = sample_trajectories

    real_step = ZoomEnvironment.step

    def step(self, sample, turn, tool_turns):
        h = zlib.crc32(f"{sample.sample_id}|{turn}|{tool_turns}".encode())
        if h % 3 == 0 or tool_turns >= self.settings.max_turns or sample.sample_id.startswith("zoom_00000"):
            return None  # it answers (at once, about the first video: a rank whose branches all end first)
        lo, hi = self.shown(sample)
        start = lo + (h % 7) / 7 * max(0.0, hi - lo - 2.0)
        if h % 5 == 0:
            start = hi + 1.0  # outside the video: an error turn
        return real_step(self, sample, call_text(round(start, 2), round(start + 2.0, 2)), tool_turns)

    ZoomEnvironment.step = step
    return mmpg.cli.main(argv)
