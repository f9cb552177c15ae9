"""One video, many questions, on the data side: a batch decodes each video once and hands every query of it the same
frames (a failed video fails each of its queries); ranks and micro-batches hold whole videos where they fit; the
evaluation's batches are whole videos. Pure functions and a stand-in decoder, no model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from mmpg.data import dataset as dataset_mod
from mmpg.data.dataset import GroundingDataset, collate_grounding
from mmpg.data.samples import GroundingSample
from mmpg.data.video import DecodedVideo, VideoError, VideoSpec
from mmpg.eval.batches import _Indexed, fixed_batches, pending_batches, video_batches
from mmpg.train.batch import PromptGroup, micro_batches
from mmpg.train.data import RankBatchSampler, pack_runs, packed_slices, video_runs


def _sample(video: str, q: int, clip=(None, None)) -> GroundingSample:
    return GroundingSample(sample_id=f"{video}#{q}", video=video, duration=10.0, query=f"query {q}", span=(1.0, 2.0),
                           clip_start=clip[0], clip_end=clip[1])


@pytest.fixture
def decoder(monkeypatch):
    """Replaces the decoder: counts calls per (file, clip), fails for files named bad*."""
    calls = []

    def fake(path, spec, clip_start=None, clip_end=None):
        calls.append((path, clip_start, clip_end))
        if path.startswith("bad"):
            raise VideoError(f"{path}: video file not found")
        return DecodedVideo(frames=torch.zeros(2, 3, 28, 28), timestamps=[0.0, 0.5], sample_fps=2.0, metadata={},
                            path=path, duration=10.0)

    monkeypatch.setattr(dataset_mod, "load_video", fake)
    return calls


def test_a_batch_decodes_each_video_once_and_shares_the_frames(decoder):
    samples = [_sample("a", 0), _sample("b", 0), _sample("a", 1), _sample("a", 2, (1.0, 5.0)), _sample("bad", 0),
               _sample("bad", 1), _sample("a", 3)]
    ds = GroundingDataset(samples, VideoSpec())
    loader = DataLoader(ds, batch_sampler=[[0, 1, 2, 3, 4, 5], [6]], collate_fn=collate_grounding)
    first, second = list(loader)
    # batch 1: a, b, a's clip, bad once each (7 queries, 4 decodes); batch 2 decodes a again (once per batch)
    assert decoder == [("a", None, None), ("b", None, None), ("a", 1.0, 5.0), ("bad", None, None), ("a", None, None)]
    assert [s.sample_id for s in first.samples] == ["a#0", "b#0", "a#1", "a#2"]
    assert first.videos[0] is first.videos[2] and first.videos[0] is not first.videos[3]  # same frames, same object
    assert [s.where for s in first.skipped] == [samples[4].where, samples[5].where]  # one skip per query of bad
    assert all("bad: video file not found" in s.reason for s in first.skipped)
    assert len(second) == 1 and not second.skipped
    assert ds[2].sample.sample_id == "a#1" and decoder[-1] == ("a", None, None)  # one item alone still works


def test_the_eval_dataset_decodes_once_per_batch_too(decoder):
    samples = [_sample("a", 0), _sample("a", 1), _sample("b", 0), _sample("a", 2)]
    ds = _Indexed(samples, [3, 1, 0, 2], VideoSpec())
    items = ds.__getitems__([0, 1, 2, 3])
    assert [i for i, _ in items] == [3, 1, 0, 2] and [it.sample.sample_id for _, it in items] == \
        ["a#2", "a#1", "a#0", "b#0"]
    assert decoder == [("a", None, None), ("b", None, None)]


def test_pack_runs_keeps_runs_whole_where_they_fit():
    # hand-worked: first fit in order; [3, 1, 2, 2] into 2 bins of 4 -> 3+1 | 2+2, nothing cut
    assert pack_runs([3, 1, 2, 2], 2, 4) == [[(0, 0, 3), (1, 0, 1)], [(2, 0, 2), (3, 0, 2)]]
    # [3, 3, 2]: the last run fits in neither bin whole: cut 1 | 1
    assert pack_runs([3, 3, 2], 2, 4) == [[(0, 0, 3), (2, 0, 1)], [(1, 0, 3), (2, 1, 2)]]
    assert pack_runs([5], 2, 3) == [[(0, 0, 3)], [(0, 3, 5)]]  # longer than a bin: split
    assert packed_slices(list("aaabccdd"), 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert packed_slices(list("abbb"), 2, 2) == [[0, 1], [2, 3]]  # b cannot be whole: cut where there is room
    with pytest.raises(ValueError):
        pack_runs([3, 3], 1, 4)


VIDEOS = ["a", "a", "a", "b", "c", "c", "d", "a", "e", "e", "e", "e"]


def test_ranks_hold_whole_videos_of_the_same_global_batch_and_resume():
    runs = video_runs(VIDEOS, 3)
    n, batch = len(VIDEOS), 6
    one = [b for _, b in zip(range(8), iter(RankBatchSampler(n, batch, 0, 1, 5, True, 0, runs)))]
    ranks = [RankBatchSampler(n, batch, r, 2, 5, True, 0, runs) for r in (0, 1)]
    shares = [[b for _, b in zip(range(8), iter(s))] for s in ranks]
    for k, whole in enumerate(one):
        a, b = shares[0][k], shares[1][k]
        assert len(a) == len(b) == 3 and sorted(a + b) == sorted(whole)  # the same prompts as one process
        # every stretch of one run in the global batch sits whole on one rank (here they always fit: e.g. batch 2
        # is 7 | 0 1 2 | 8 9 -> rank 0: 7 8 9, rank 1: 0 1 2; the stream order would have cut 0 1 2)
        assert all(set(p) <= set(a) or set(p) <= set(b) for p in _runs_in(whole, runs)), (whole, a, b)
    resumed = RankBatchSampler(n, batch, 1, 2, 5, True, 3 * batch, runs)  # a checkpoint after 3 global batches
    assert [b for _, b in zip(range(5), iter(resumed))] == shares[1][3:]
    # epoch by epoch every query once, over both ranks
    flat = [i for k in range(4) for i in shares[0][k] + shares[1][k]]
    assert sorted(flat[:n]) == list(range(n)) and sorted(flat[n:2 * n]) == list(range(n))


def _runs_in(batch, runs):
    """The batch's maximal stretches of one run (what the packer keeps whole)."""
    run_of = {i: r for r, run in enumerate(runs) for i in run}
    out = []
    for i in batch:
        if out and run_of[out[-1][-1]] == run_of[i]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def test_ranks_without_runs_take_consecutive_shares():
    ranks = [next(iter(RankBatchSampler(10, 4, r, 2, 0, False, 4))) for r in (0, 1)]
    assert ranks == [[4, 5], [6, 7]]


def _group(video: str, q: int, size: int = 2) -> PromptGroup:
    ids = torch.tensor([[1, 2, 3 + q]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # [1, 3]
    return PromptGroup(sample=_sample(video, q), video=None, inputs=inputs,
                       completion_ids=torch.ones(size, 2, dtype=torch.long), completion_mask=torch.ones(size, 2),
                       rollout_logprobs=torch.zeros(size, 2), texts=[""] * size, finish_reasons=["stop"] * size,
                       advantages=torch.zeros(size))


def test_micro_batches_hold_whole_videos_where_they_fit():
    groups = [_group("a", 0), _group("b", 0), _group("b", 1), _group("c", 0), _group("c", 1), _group("d", 0)]
    # 3 groups per micro-batch, 2 micro-batches as before: a | b b | c c | d -> a b b | c c d
    mbs = micro_batches(groups, 3, 0)
    assert [[g.sample.sample_id for g in mb.groups] for mb in mbs] == [["a#0", "b#0", "b#1"], ["c#0", "c#1", "d#0"]]
    # 2 per micro-batch: a | b b | c c | d into 3 micro-batches: a d | b b | c c
    mbs = micro_batches(groups, 2, 0)
    assert [[g.sample.sample_id for g in mb.groups] for mb in mbs] == [["a#0", "d#0"], ["b#0", "b#1"], ["c#0", "c#1"]]
    assert all(mb.completion_ids.shape[0] == sum(mb.group_sizes) for mb in mbs)
    # a video longer than a micro-batch is split, each part together
    many = [_group("a", q) for q in range(5)]
    assert [len(mb.groups) for mb in micro_batches(many, 2, 0)] == [2, 2, 1]


def test_eval_batches_are_whole_videos_packed_up_to_batch_size():
    keys = ["a", "a", "b", "b", "b", "a", "c"]
    # videos in order of their first query: a (0 1 5), b (2 3 4), c (6); b does not fit beside a
    assert video_batches(keys, 4) == [[0, 1, 5], [2, 3, 4, 6]]
    assert video_batches(keys, 2) == [[0, 1], [5], [2, 3], [4, 6]]  # a and b split, c beside b's last
    assert video_batches(["a"] * 5 + ["b"], 2) == [[0, 1], [2, 3], [4, 5]]
    samples = [_sample(k, i) for i, k in enumerate(keys)]
    assert pending_batches(samples, list(range(7)), 4, True) == [[0, 1, 5], [2, 3, 4, 6]]
    assert pending_batches(samples, [1, 4, 6], 4, True) == [[1], [4, 6]]  # resumed: the rest of each fixed batch
    assert pending_batches(samples, [1, 4, 6], 4, False) == fixed_batches([1, 4, 6], 4) == [[1], [4, 6]]
    assert pending_batches(samples, [5], 4, False) == [[5]]
    clipped = [_sample("a", 0), _sample("a", 1, (0.0, 4.0)), _sample("a", 2)]  # another clip: another video
    assert pending_batches(clipped, [0, 1, 2], 4, True) == [[0, 2, 1]]
    assert pending_batches(clipped, [0, 1, 2], 2, True) == [[0, 2], [1]]


def test_a_videos_queries_apart_in_a_batch_go_to_one_rank():
    from mmpg.train.data import runs_of

    assert runs_of(list("aaba")) == [[0, 1, 3], [2]]
    # [a a b c a] into 2 ranks of 3: a's three queries (positions 0, 1, 4) on one rank, b and c on the other
    assert packed_slices(list("aabca"), 2, 3) == [[0, 1, 4], [2, 3]]
    # an epoch boundary inside a global batch: video 0's queries come as two runs (end of epoch 0, start of epoch
    # 1); keyed by video, both land on one rank
    videos = ["v0", "v0", "v1", "v1"]
    runs = video_runs(videos, 2)  # [[0, 1], [2, 3]]
    ranks = [next(iter(RankBatchSampler(4, 4, r, 2, seed=0, shuffle=False, start=2, runs=runs, videos=videos)))
             for r in range(2)]
    assert ranks == [[2, 3], [0, 1]]  # stream 2..5 = v1 v1 | v0 v0: each video on one rank


def test_split_videos_counts_videos_trained_on_several_ranks():
    from mmpg.rl.trainer import split_videos

    assert split_videos([[{"video": "a"}, {"video": "b"}], [{"video": "a"}, {"video": "c"}]]) == 1
    assert split_videos([[{"video": "a"}, {"video": "a"}], [{"video": "b"}]]) == 0
