"""Dynamic sampling in the prompt book (services/job/prompt_book.py): zero-advantage groups dropped and replaced
for their step, the bound on prompts drawn per step, the step's numbers, and the state a checkpoint keeps."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from job_fakes import prompts

from protocol import Trajectory, TrajectoryGroup, encode
from services.job.prompt_book import PromptBook
from services.data.prompt_source import PromptSource


def rewarded(pid: str, rewards: Sequence[float | None], step: int = 1) -> TrajectoryGroup:
    """A group of ``pid`` whose samples have ``rewards`` (None: a failed sample)."""
    trajs = [Trajectory(np.array([1, 2]), np.array([-0.5, -0.25]), np.array([0, 0]), r,
                        "stop" if r is not None else "error",
                        "" if r is not None else "boom") for r in rewards]
    return TrajectoryGroup(f"g-{pid}", pid, np.array([5]), trajs, len(rewards), 16, scheduled_step=step)


def book_of(max_prompts: int | None, per_step: int = 2) -> tuple[PromptBook, list[str]]:
    """A book drawing from 64 prompts, ``per_step`` groups a step; the second value collects submitted ids."""
    submitted: list[str] = []
    book = PromptBook(PromptSource(prompts(64), seed=0), lambda reqs: submitted.extend(r.prompt_id for r in reqs),
                      per_step=per_step, last_step=10, max_age=1, max_prompts_per_step=max_prompts)
    return book, submitted


SIGNAL, FLAT = [0.0, 1.0], [1.0, 1.0]


def test_zero_advantage_groups_are_dropped_and_replaced_for_their_step_until_the_step_has_signal():
    book, submitted = book_of(max_prompts=6)
    book.schedule(1)
    a, b = submitted
    book.receive(encode(rewarded(a, FLAT)))
    book.receive(encode(rewarded(b, [0.5, 0.5, None])))                # 2 valid samples, equal: no signal
    assert book.ledger.dropped == {a: "zero_advantage", b: "zero_advantage"} and book.ready(1) == 0
    c, d = submitted[2:]
    assert book.ledger.scheduled[c] == book.ledger.scheduled[d] == 1   # replacements for the same step, at once
    book.receive(encode(rewarded(c, SIGNAL)))
    book.receive(encode(rewarded(d, [0.0, 0.2])))
    assert book.screen(1, version=0) == 2
    taken = book.take(1)
    stats = book.sampling_stats(1, taken)
    assert stats is not None and stats.metrics() == {"dynamic_sampling_dropped": 2.0,
                                                     "dynamic_sampling_attempts": 2.0,
                                                     "dynamic_sampling_exhausted": 0.0}
    assert book.buffer.drops == {"zero_advantage": 2} and book.take_rejected() == {"zero_advantage": 2}


def test_a_group_with_fewer_than_two_valid_samples_is_dropped_as_before_not_as_zero_advantage():
    book, submitted = book_of(max_prompts=6)
    book.schedule(1)
    book.receive(encode(rewarded(submitted[0], [1.0, None])))
    assert book.screen(1, version=0) == 0 and book.ledger.dropped == {submitted[0]: "too_few_valid_samples"}


def test_past_the_bound_zero_advantage_groups_are_trained_and_counted_as_exhausted():
    book, submitted = book_of(max_prompts=3)
    book.schedule(1)
    a, b = submitted
    book.receive(encode(rewarded(a, FLAT)))                            # 2 drawn < 3: dropped, replaced (3 drawn)
    (c,) = submitted[2:]
    book.receive(encode(rewarded(b, FLAT)))                            # the bound is reached: kept
    book.receive(encode(rewarded(c, [0.0, 0.0])))                      # kept
    assert len(submitted) == 3 and book.ledger.dropped == {a: "zero_advantage"}
    assert book.screen(1, version=0) == 2                              # the step still gets its groups
    taken = book.take(1)
    stats = book.sampling_stats(1, taken)
    assert stats is not None and (stats.dropped, stats.attempts, stats.exhausted) == (1, 1.5, 2)
    book.settle(taken, trained=True)
    assert book.ledger.trained == {b: 1, c: 1} and book.drawn == {} and book.zero_advantage_drops == {}


def test_off_nothing_is_dropped_for_zero_advantage_and_there_are_no_numbers():
    book, submitted = book_of(max_prompts=None)
    book.schedule(1)
    for pid in submitted:
        book.receive(encode(rewarded(pid, FLAT)))
    assert book.screen(1, version=0) == 2 and book.ledger.dropped == {} and len(submitted) == 2
    assert book.sampling_stats(1, book.take(1)) is None


def test_replacements_for_a_later_step_count_for_that_step_and_a_restore_keeps_the_counts():
    book, submitted = book_of(max_prompts=4)
    book.schedule(1)
    book.schedule(2)                                                   # async: the next step drawn ahead
    book.receive(encode(rewarded(submitted[2], FLAT, step=2)))         # a group of step 2 arrives early
    (r,) = submitted[4:]
    assert book.ledger.scheduled[r] == 2 and book.drawn == {1: 2, 2: 3} and book.zero_advantage_drops == {2: 1}
    again, _ = book_of(max_prompts=4)
    again.restore(book.state())
    assert again.drawn == book.drawn and again.zero_advantage_drops == book.zero_advantage_drops
    assert again.buffer.drops == {"zero_advantage": 1}


def test_dynamic_sampling_judges_rewards_after_reward_scaling():
    from learner.config import RewardScalingConfig

    submitted: list[str] = []
    book = PromptBook(PromptSource(prompts(64), seed=0), lambda reqs: submitted.extend(r.prompt_id for r in reqs),
                      per_step=1, last_step=10, max_age=1, max_prompts_per_step=4,
                      reward_scaling=RewardScalingConfig(enabled=True, target_min=-1.0))
    book.schedule(1)
    book.receive(encode(rewarded(submitted[0], [1.0, 1.5])))           # both clamp to 1.0: no signal once scaled
    assert book.ledger.dropped == {submitted[0]: "zero_advantage"} and len(submitted) == 2
