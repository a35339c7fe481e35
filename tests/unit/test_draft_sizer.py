"""DraftSizer: the draft count per list length K, on a fixed ladder of multiples of K, learned from coverage
(drafts that fell short or served) and, once a policy reports them, from what requests cost."""

import threading

from specrec.backends.base import DRAFT_FACTORS, draft_count
from specrec.policies.draft_sizer import DraftSizer


def test_the_ladder_is_the_draft_factors_times_k_rounded_up():
    s = DraftSizer()
    assert s.ladder(10) == [10, 15, 20, 30, 40, 60]
    assert s.ladder(3) == [3, 5, 6, 9, 12, 18]
    assert s.ladder(7) == sorted({draft_count(m, 7) for m in DRAFT_FACTORS})


def test_it_starts_at_the_first_ladder_count_at_or_above_start_factor_times_k():
    assert DraftSizer().size(10) == 15
    assert DraftSizer(start_factor=1.6).size(10) == 20
    assert DraftSizer(start_factor=100).size(10) == 60  # beyond the ladder: its top


def test_drafts_that_fall_short_grow_the_count_and_served_ones_shrink_it():
    s = DraftSizer()
    s.observe(10, short=True)  # 15 * 1.2 = 18 -> 20 on the ladder
    assert s.size(10) == 20
    for _ in range(20):
        s.observe(10, short=False)  # x0.95 each, down to min_factor * K
    assert s.size(10) == 10


def test_the_count_stays_within_min_and_max_factor_times_k():
    s = DraftSizer(min_factor=1.5, max_factor=3.0)
    for _ in range(100):
        s.observe(10, short=True)
    assert s.size(10) == 30
    for _ in range(1000):
        s.observe(10, short=False)
    assert s.size(10) == 15
    assert all(s.size(10) in s.ladder(10) for _ in range(5))


def test_each_k_learns_on_its_own():
    s = DraftSizer()
    for _ in range(10):
        s.observe(10, short=True)
    assert s.size(10) == 60
    assert s.size(20) == 30  # untouched: 1.5 * 20


def test_with_costs_the_cheapest_count_is_chosen_and_a_neighbour_tried_every_explore_every_th_request():
    s = DraftSizer(explore_every=4)
    s.observe_cost(10, 15, 0.03)
    s.observe_cost(10, 20, 0.01)
    s.observe_cost(10, 30, 0.02)
    asked = [s.size(10) for _ in range(8)]
    # asks 4 and 8 explore: the ladder neighbours of 20, in turn (30 then 15)
    assert asked == [20, 20, 20, 30, 20, 20, 20, 15]


def test_costs_are_running_means_so_a_count_that_turns_expensive_loses_its_place():
    s = DraftSizer(explore_every=1000, alpha=0.5)
    s.observe_cost(10, 20, 0.01)
    s.observe_cost(10, 30, 0.02)
    assert s.size(10) == 20
    s.observe_cost(10, 20, 0.05)  # mean 0.03
    assert s.size(10) == 30


def test_costs_take_over_from_coverage_for_their_k_only():
    s = DraftSizer(explore_every=1000)
    for _ in range(10):
        s.observe(10, short=True)
        s.observe(20, short=True)
    s.observe_cost(10, 15, 0.01)
    assert s.size(10) == 15  # coverage alone would say 60
    assert s.size(20) == 120


def test_threads_sharing_one_sizer_see_counts_on_the_ladder():
    s = DraftSizer(explore_every=3)
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(500):
                s.observe(10, short=(i + seed) % 3 == 0)
                s.observe_cost(10, s.ladder(10)[(i + seed) % 6], 0.001 * ((i * seed) % 7 + 1))
                assert s.size(10) in s.ladder(10)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
