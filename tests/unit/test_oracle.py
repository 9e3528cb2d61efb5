"""proxima.replay.oracle: contents read off vLLM's block list, and the no-move layouts.

The recorder is fed block objects shaped like vLLM's ``KVCacheBlock`` (the attributes it
reads); tests/vllm/test_oracle.py feeds it a real replay. The layouts are checked on a
hand-worked case and, with hypothesis, for feasibility on random contents: a layout that
puts more contents in a granule than it has ids at some step is no layout at all.
"""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")

from proxima.replay.oracle import (ContentRecorder, _span, best_fit_own_future,  # noqa: E402
                                   first_fit_latest_end, score)


def blocks(n, live=(), hashes=None):
    hashes = hashes or {}
    return [SimpleNamespace(block_id=i, ref_cnt=1 if (i in live or i == 0) else 0,
                            is_null=i == 0, block_hash=hashes.get(i)) for i in range(n)]


def test_a_prefix_hit_revives_the_same_content_and_a_new_hash_is_a_new_one():
    rec = ContentRecorder()
    rec(1, blocks(4, live={1, 2}))                      # 1 partial, 2 filling
    rec(2, blocks(4, live={1, 2}, hashes={2: "h2"}))    # 2 is full now
    rec(3, blocks(4, hashes={2: "h2"}))                 # freed: 2 cached, 1 free
    rec(4, blocks(4, live={1, 2}, hashes={2: "h2"}))    # 2 hit again; 1 holds new content
    rec(5, blocks(4, live={2}, hashes={2: "h2"}))
    rec(6, blocks(4, hashes={2: "h2"}))
    rec(7, blocks(4, live={2}, hashes={2: "h3"}))       # evicted, refilled: new content
    assert rec.samples == 7
    by_id = {}
    for intervals, i in rec.contents:
        by_id.setdefault(i, []).append(intervals)
    assert by_id[1] == [[[0, 2]], [[3, 4]]]             # a partial block is never revived
    assert by_id[2] == [[[0, 2], [3, 5]], [[6, 7]]]
    assert all(i != 0 for _, i in rec.contents)         # the null block is no content


def test_first_fit_latest_end_keeps_room_a_later_long_content_needs():
    # G = 2, granules 0 (the null block and one id), 1 and 2; steps 0..9.
    A, B, D, E = [[1, 10]], [[2, 10]], [[3, 5]], [[4, 10]]
    contents = [[A, 1], [B, 2], [D, 3], [E, 4]]
    # In order of appearance, short D takes the id in granule 1 (busy anyway, costs
    # nothing) that long E then lacks: E opens granule 2 for six steps. Clairvoyant, E
    # goes first and D, short, opens granule 2 for two.
    assert best_fit_own_future(contents, 10, 6, 2) == [0, 1, 1, 2]
    assert first_fit_latest_end(contents, 10, 6, 2) == [0, 1, 2, 1]
    bf = score([0, 1, 1, 2], contents, 10, 6, 2)
    ff = score([0, 1, 2, 1], contents, 10, 6, 2)
    # used granules per step: best fit 1 1 2 2 3 3 3 3 3 3; first fit 1 1 2 3 3 2 2 2 2 2
    assert bf["reclaimable_granule_fraction"] == pytest.approx(6 / 30)
    assert ff["reclaimable_granule_fraction"] == pytest.approx(10 / 30)
    # live counts 1 2 3 4 5 4 4 4 4 4 (with the null block): packed 1 1 2 2 3 2 2 2 2 2
    assert ff["packed_ideal_fraction"] == bf["packed_ideal_fraction"] == pytest.approx(11 / 30)


contents_st = st.lists(
    st.lists(st.tuples(st.integers(0, 29), st.integers(1, 6)), min_size=1, max_size=3),
    min_size=1, max_size=40)


def as_contents(raw):
    out = []
    for pieces in raw:
        intervals, t = [], 0
        for gap, length in sorted(pieces):
            start = max(t, gap)
            intervals.append([start, start + length])
            t = start + length + 1
        out.append([intervals, 0])
    return out


@settings(max_examples=60, deadline=None)
@given(contents_st, st.sampled_from([1, 2, 4]))
def test_every_layout_fits_its_granules_and_none_beats_the_packed_ideal(raw, G):
    contents = as_contents(raw)
    steps = max(iv[-1][1] for iv, _ in contents)
    # enough ids for all of them at once: a layout always exists
    num_blocks = G * (len(contents) + 2) - 1
    for layout in (best_fit_own_future, first_fit_latest_end):
        assign = layout(contents, steps, num_blocks, G)
        ng = -(-num_blocks // G)
        occ = np.zeros((ng, steps + 1), dtype=int)
        occ[0, :] = 1
        for (intervals, _), g in zip(contents, assign):
            s, e = _span(intervals)
            occ[g, s:e] += 1
        size = np.full(ng, G)
        size[-1] = num_blocks - (ng - 1) * G
        assert (occ <= size[:, None]).all(), layout.__name__
        got = score(assign, contents, steps, num_blocks, G)
        assert got["reclaimable_granule_fraction"] <= got["packed_ideal_fraction"] + 1e-12


def test_an_unusable_out_directory_is_one_line_and_exit_2(tmp_path, capsys):
    from proxima.replay.oracle import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and str(blocker / "sub") in err
