"""The gateway's pool of cloud-led Drafts: the freshest consistent one lends its tokens beyond
committed_len; stale ones are dropped and counted."""

from specsplit.cloud.gateway.cloud_led import POOL, DraftPool, PendingDraft

COMMITTED = [1, 2, 3, 4, 5]


def _pool(*drafts: tuple[int, list[int]]) -> DraftPool:
    pool = DraftPool()
    for i, (base, tokens) in enumerate(drafts, start=1):
        pool.add(PendingDraft(i, base, tokens, None))
    return pool


def test_takes_the_freshest_consistent_draft_beyond_committed():
    pool = _pool((3, [4, 5, 6, 7]), (4, [5, 8, 9]))  # both continue [1, 2, 3, 4, 5]
    draft, tokens, q = pool.take(COMMITTED, limit=8)
    assert draft.round == 2 and tokens == [8, 9] and q == []


def test_an_inconsistent_draft_is_dropped_and_counted():
    pool = _pool((3, [4, 9, 6]), (2, [3, 4, 5, 6]))  # the first guessed 9 where 5 was committed
    draft, tokens, _ = pool.take(COMMITTED, limit=8)
    assert draft.round == 2 and tokens == [6]
    assert pool.dropped == 1 and len(pool.drafts) == 1


def test_a_used_draft_serves_its_rest_later_and_is_not_counted_as_dropped():
    pool = _pool((5, [6, 7, 8, 9]))
    _, tokens, _ = pool.take(COMMITTED, limit=2)
    assert tokens == [6, 7]
    _, tokens, _ = pool.take([*COMMITTED, 6, 7, 8], limit=2)  # all accepted, bonus 8 matched
    assert tokens == [9]
    _, tokens, _ = pool.take([*COMMITTED, 6, 7, 8, 9, 1], limit=2)  # exhausted: gone
    assert tokens == [] and pool.dropped == 0 and pool.used == 1


def test_no_draft_means_a_plain_target_step():
    draft, tokens, q = DraftPool().take(COMMITTED, limit=4)
    assert draft is None and tokens == [] and q == []


def test_the_pool_holds_a_bounded_number_of_drafts():
    pool = _pool(*[(5, [i]) for i in range(POOL + 12)])
    assert len(pool.drafts) == POOL and pool.dropped == 12


def test_a_continuation_extends_the_previous_draft():
    pool = _pool((5, [6, 7]))
    pool.add(PendingDraft(2, 7, [8, 9], None), continues=True, committed_len=5)
    assert len(pool.drafts) == 1
    draft, tokens, _ = pool.take(COMMITTED, limit=8)
    assert draft.round == 2 and tokens == [6, 7, 8, 9]
    # it may start before committed_len: the cloud verified part of the parent meanwhile
    pool.add(PendingDraft(3, 9, [10], None), continues=True, committed_len=8)
    _, tokens, _ = pool.take([*COMMITTED, 6, 7, 8], limit=8)
    assert tokens == [9, 10]


def test_a_continuation_of_a_draft_that_is_gone_stands_alone_or_is_dropped():
    pool = _pool((3, [4, 9]))  # inconsistent with COMMITTED: dropped by the next take
    assert pool.take(COMMITTED, limit=8)[0] is None and pool.dropped == 1
    # starts past committed_len: what comes before it is unknown here
    pool.add(PendingDraft(2, 6, [1], None), continues=True, committed_len=5)
    assert not pool.drafts and pool.dropped == 2
    # starts within the committed prefix: checked against it like any Draft
    pool.add(PendingDraft(3, 4, [5, 6], None), continues=True, committed_len=5)
    draft, tokens, _ = pool.take(COMMITTED, limit=8)
    assert draft.round == 3 and tokens == [6]


def test_a_continuation_must_start_where_the_previous_draft_ended():
    pool = _pool((5, [6, 7]))
    pool.add(PendingDraft(2, 8, [9], None), continues=True, committed_len=5)  # a gap at 7
    assert [d.round for d in pool.drafts] == [1] and pool.dropped == 1


def test_a_branch_is_taken_only_where_no_other_draft_is_consistent():
    pool = _pool((5, [6, 7, 8]))
    # the edge's branch (its second choice 9 at position 6), fresher than its speculation
    pool.add(PendingDraft(2, 5, [6, 9, 10], None, branch=True))
    assert pool.ahead(COMMITTED) == 3
    draft, tokens, _ = pool.take(COMMITTED, limit=8)
    assert draft.round == 1 and tokens == [6, 7, 8]
    # the cloud corrected position 6 to 9: the speculation is stale, the branch verified
    draft, tokens, _ = pool.take([*COMMITTED, 6, 9], limit=8)
    assert draft.round == 2 and tokens == [10] and pool.ahead([*COMMITTED, 6, 9]) == 1


def test_a_continuation_never_extends_a_branch():
    pool = _pool((5, [6, 7]))
    pool.add(PendingDraft(2, 5, [6, 9], None, branch=True))
    pool.add(PendingDraft(3, 7, [8], None), continues=True, committed_len=5)  # past: unknown
    assert [d.round for d in pool.drafts] == [1, 2] and pool.dropped == 1
