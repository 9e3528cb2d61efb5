"""The scheduler -> worker op encoding and the workers' reports."""

import pickle

import pytest

from proxima.memory.ops import MAP, UNMAP, Op, OpBatch, Report, merge_reports, validate


def test_ops_are_small_tuples_of_ints_that_pickle_and_read_back():
    batch = OpBatch(7, (Op.unmap(3, 2), Op.map(3, 1)))
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch and back.ops[0] == (UNMAP, 3, 2) and back.ops[1].code == MAP
    assert [op.kind for op in back.ops] == ["unmap", "map"]
    assert str(back.ops[1]) == "map granules [3, 4)"
    assert all(type(x) is int for op in back.ops for x in op)


@pytest.mark.parametrize("op, message", [
    (Op.map(9, 2), "outside the pool's 10 granules"),
    (Op.map(-1, 1), "outside"),
    (Op.unmap(0, 1), "null block"),
    (Op(3, 0, 1), "unknown op code 3"),      # MOVE's code: block moves travel elsewhere
])
def test_validate_names_the_bad_op(op, message):
    with pytest.raises(ValueError, match=message):
        validate([op], num_granules=10, num_blocks=320)


def test_validate_accepts_ops_inside_the_pool():
    validate([Op.map(1, 9), Op.unmap(9, 1)], 10, 320)


def test_reports_of_two_workers_merge_to_the_union_of_failures():
    a = Report(((4, ()), (5, ((8, 2),))), mapped_granules=9, granule_blocks=32)
    b = Report(((4, ((3, 1),)), (5, ())), mapped_granules=10, granule_blocks=32)
    merged = merge_reports(a, b)
    assert merged == Report(((4, ((3, 1),)), (5, ((8, 2),))), 9, 32, counts=(2, 2))
    with pytest.raises(ValueError, match="disagree"):
        merge_reports(a, Report((), 1, 16))


def test_merged_reports_count_the_workers_of_each_batch():
    """Workers that map in the background report a batch in different steps: one step's
    merged report may cover batch 5 for one worker and batch 4 for both."""
    a = Report(((4, ()), (5, ())), mapped_granules=9, granule_blocks=32)
    b = Report(((4, ()),), mapped_granules=8, granule_blocks=32)
    c = Report(((6, ((1, 1),)),), mapped_granules=8, granule_blocks=32)
    merged = merge_reports(merge_reports(a, b), c)
    assert merged.entries() == [(4, (), 2), (5, (), 1), (6, ((1, 1),), 1)]
    assert merged.mapped_granules == 8
