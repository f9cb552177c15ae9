"""data.queries_per_video (mmpg/train/data.py): up to K queries of one video side by side in the epoch order, each
query once per epoch, a pure function of (seed, epoch) so that a stream position resumes it; and in training the
side-by-side queries share their video in the grouped forward."""

from __future__ import annotations

from mmpg.train.data import RankBatchSampler, stream_indices, video_runs

VIDEOS = ["a", "a", "a", "b", "c", "c", "d", "a", "e", "e", "e", "e"]  # a has 4 queries (one out of order), e 4


def test_runs_cut_each_video_into_at_most_k_queries():
    assert video_runs(VIDEOS, 1) is None
    assert video_runs(VIDEOS, 3) == [[0, 1, 2], [7], [3], [4, 5], [6], [8, 9, 10], [11]]
    assert video_runs(VIDEOS, 2) == [[0, 1], [2, 7], [3], [4, 5], [6], [8, 9], [10, 11]]


def test_epochs_keep_runs_together_and_every_query_once():
    runs = video_runs(VIDEOS, 3)
    n = len(VIDEOS)
    for epoch in range(3):
        order = stream_indices(n, 7, True, epoch * n, n, runs)
        assert sorted(order) == list(range(n))
        for run in runs:  # each run appears contiguous and in its own order
            at = order.index(run[0])
            assert order[at:at + len(run)] == run
    assert stream_indices(n, 7, True, 0, n, runs) != stream_indices(n, 7, True, n, n, runs)  # reshuffled per epoch
    assert stream_indices(n, 7, False, 0, n, runs) == [0, 1, 2, 7, 3, 4, 5, 6, 8, 9, 10, 11]


def test_a_stream_position_resumes_the_same_batches():
    runs = video_runs(VIDEOS, 3)
    whole = RankBatchSampler(len(VIDEOS), 4, 0, 1, 3, True, 0, runs)
    batches = [b for _, b in zip(range(6), iter(whole))]
    resumed = RankBatchSampler(len(VIDEOS), 4, 0, 1, 3, True, 8, runs)  # after two batches of 4
    assert [b for _, b in zip(range(4), iter(resumed))] == batches[2:]
    ranks = [RankBatchSampler(len(VIDEOS), 4, r, 2, 3, True, 0, runs) for r in (0, 1)]
    firsts = [next(iter(s)) for s in ranks]
    # the ranks share the same global batch [8 9 10 | 4]; the run 8 9 10 fits on no rank of 2 and is cut, 4 goes
    # first fit to rank 0 (whole videos per rank: tests/test_video_sharing.py)
    assert batches[0] == [8, 9, 10, 4] and firsts == [[8, 4], [9, 10]]
