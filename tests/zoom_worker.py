"""`mmpg train ARGV` in a forked process whose zoom tool is scripted (tests/test_zoom_grpo.py): the tiny models are
random and never write a call, so half the vocabulary stops a turn (as tests/test_zoom_rollout.py samples) and
every model turn that stopped is taken as a call whose window depends on the turn's text (one in three turns answers
instead, one call in five asks past the video for an error turn), until zoom.max_turns; about the first video it
always answers at once (with MMPG_ZOOM_ERRORS=1 it calls as about the others, and every call about the second video
asks past it instead). Everything else is the real path: the trajectories' tokens, clips, rewards, the trajectory
tree, the self-check and the update.
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    import os
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
    # MMPG_ZOOM_ERRORS=1: the first video's turns call the tool as the others' do, and every call about the second
    # asks past the video (a rank whose turn holds only error turns while another's holds clips)
    errors = os.environ.get("MMPG_ZOOM_ERRORS") == "1"

    def step(self, sample, turn, tool_turns):
        h = zlib.crc32(f"{sample.sample_id}|{turn}|{tool_turns}".encode())
        first, second = (sample.sample_id.startswith(f"zoom_0000{k}") for k in (0, 1))
        if tool_turns >= self.settings.max_turns or (first and not errors) or (h % 3 == 0 and not errors):
            return None  # it answers (at once, about the first video: a rank whose branches all end first)
        lo, hi = self.shown(sample)
        start = lo + (h % 7) / 7 * max(0.0, hi - lo - 2.0)
        if h % 5 == 0 or (errors and second):
            start = hi + 1.0  # outside the video: an error turn
        return real_step(self, sample, call_text(round(start, 2), round(start + 2.0, 2)), tool_turns)

    ZoomEnvironment.step = step
    return mmpg.cli.main(argv)
