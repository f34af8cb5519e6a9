"""The prompt book (services/job/prompt_book.py): what it does with each message from the pool, undelivered
prompts, replacements and their back-off, a train step's outcome, and its checkpoint state."""
from __future__ import annotations

from job_fakes import group, prompts

from protocol import ControlMessage, PromptRequest, decode, encode
from protocol.pool_replies import UndeliveredPrompt
from services.job.backoff import ReplacementBackoff
from services.job.prompt_book import PromptBook
from services.data.prompt_source import PromptSource


def book_of(last_step: int = 10, max_age: int = 1) -> tuple[PromptBook, list[list[str]]]:
    """A book drawing from 8 prompts; the second value collects the prompt ids of each submission."""
    submitted: list[list[str]] = []
    book = PromptBook(PromptSource(prompts(), seed=0), lambda reqs: submitted.append([r.prompt_id for r in reqs]),
                      per_step=1, last_step=last_step, max_age=max_age)
    return book, submitted


def scheduled(book: PromptBook, *steps: int) -> list[str]:
    for step in steps:
        book.schedule(step)
    return list(book.ledger.scheduled)


def test_schedule_draws_records_and_submits_and_nothing_after_the_last_step():
    book, submitted = book_of(last_step=2)
    ids = scheduled(book, 1, 2, 3)
    assert len(ids) == 2 and submitted == [[ids[0]], [ids[1]]]
    assert book.ledger.pending() == {ids[0]: 1, ids[1]: 2} and list(book.open_requests) == ids


def test_duplicates_of_requeued_prompts_are_counted_and_never_trained():
    book, _ = book_of()
    a, b = scheduled(book, 1, 1)
    book.receive(encode(group(a)))
    book.receive(encode(group(a)))                                     # buffered already
    book.receive(encode(group("zz")))                                  # never scheduled
    book.ledger.mark_trained(b, 1)
    book.receive(encode(group(b)))                                     # trained already
    book.receive(b"\x00junk")
    book.receive(encode(PromptRequest("x", [1])))
    assert book.rejected == {"duplicate": 2, "unexpected_group": 1, "malformed": 1, "unexpected_kind": 1}
    assert [bg.group.prompt_id for bg in book.buffer.all_groups()] == [a]
    counts = dict(book.rejected)
    assert book.take_rejected() == counts and book.rejected == {}


def test_an_error_report_for_a_buffered_prompt_does_not_drop_it():
    book, submitted = book_of()
    a, b = scheduled(book, 1, 1)
    book.receive(encode(group(a)))
    for pid in (a, b):
        book.receive(encode(ControlMessage("error", {"prompt_id": pid, "scheduled_step": 1, "reason": "x"}, 0.0)))
    assert book.ledger.is_open(a) and book.buffer.holds(a)             # its first group stays and is trained
    assert book.ledger.dropped == {b: "generation_failed"}
    (replacement,) = submitted[-1]                                     # the first failure in a row: at once
    assert book.ledger.scheduled[replacement] == 1 and book.rejected == {"generation_failed": 1}


def test_undelivered_prompts_are_dropped_with_a_reason_and_replaced_once():
    book, submitted = book_of()
    a, b, c = scheduled(book, 2, 2, 2)
    book.receive(encode(group(b, 2)))                                  # b's group did arrive (buffered)
    book.ledger.mark_dropped(c, "stale")
    records = [UndeliveredPrompt(p, 2, "channel send failed: full", engine_id="e0") for p in (a, b, c)]
    assert book.drop_undelivered(records) == 1                         # only a: b is buffered, c already finished
    assert book.ledger.dropped == {c: "stale", a: "undelivered"} and len(submitted) == 4
    assert book.rejected == {"undelivered": 1}
    assert book.drop_undelivered(records) == 0                         # a is finished now


def test_screening_drops_and_replaces_and_remembers_why_a_sample_failed():
    book, submitted = book_of()
    (a,) = scheduled(book, 1)
    book.receive(encode(group(a, good=False)))
    assert book.screen(1, version=0) == 0
    assert book.ledger.dropped == {a: "too_few_valid_samples"} and book.last_sample_error == "engine on fire"
    (replacement,) = submitted[-1]
    book.receive(encode(group(replacement)))
    assert book.screen(1, version=0) == 1 and book.ready(1) == 1
    assert [b.group.prompt_id for b in book.take(1)] == [replacement]
    assert "too_few_valid_samples" in book.losses() and "last failed sample: engine on fire" in book.losses()


def test_replacements_of_failures_in_a_row_are_held_then_submitted_when_due():
    now = [0.0]
    book, submitted = book_of()
    book.backoff = ReplacementBackoff(base_s=1.0, max_s=4.0, clock=lambda: now[0])
    ids = scheduled(book, 1, 1)
    book.drop(ids[0], "generation_failed", replace_for=1)             # the first failure: replaced at once
    book.drop(ids[1], "generation_failed", replace_for=1)             # the second in a row: held 1 s
    assert len(submitted) == 3 and book.next_due_in() == 1.0
    book.submit_due()
    assert len(submitted) == 3
    now[0] = 1.0
    book.submit_due()
    assert len(submitted) == 4 and book.next_due_in() is None
    book.progressed()
    assert book.backoff.failures_in_a_row == 0


def test_a_train_step_settles_its_groups_trained_or_dropped_as_skipped():
    book, _ = book_of()
    a, b = scheduled(book, 1, 2)
    book.receive(encode(group(a, 1)))
    book.receive(encode(group(b, 2)))
    book.settle(book.take(1), trained=True)
    book.settle(book.take(2), trained=False)
    assert book.ledger.trained == {a: 1} and book.ledger.dropped == {b: "step_skipped"}
    assert book.open_requests == {} and book.ledger.pending() == {}


def test_outstanding_prompts_are_resubmitted_after_a_restore():
    book, _ = book_of()
    a, b, c = scheduled(book, 1, 1, 2)
    book.receive(encode(group(a, 1)))
    book.buffer.drops["stale"] = 3
    state = book.state()
    again, submitted = book_of()
    again.restore(state)
    assert again.resubmit_outstanding() and submitted == [[b, c]]      # a's group is buffered: not again
    assert again.ledger.pending() == book.ledger.pending() and again.buffer.holds(a)
    assert again.buffer.drops == {"stale": 3} and again.source.position() == book.source.position()
    assert decode(state.open_requests[0]).prompt_id == a
    assert [r.prompt_id for r in again.source.next(2, 3)] == [r.prompt_id for r in book.source.next(2, 3)]
    fresh, none = book_of()
    assert not fresh.resubmit_outstanding() and none == []


def test_the_run_ends_at_the_last_step_the_data_epochs_can_fill_and_replacements_still_draw():
    from job_fakes import prompts as make_prompts

    from services.job.prompt_book import PromptBook
    from services.data.prompt_source import PromptSource

    submitted: list[str] = []
    source = PromptSource(make_prompts(10), seed=0, max_epochs=1)       # 10 prompts, one epoch: two steps of 4
    book = PromptBook(source, lambda reqs: submitted.extend(r.prompt_id for r in reqs), per_step=4, last_step=5,
                      max_age=1)
    book.schedule(1)
    book.schedule(2)
    assert book.last_step == 5 and len(submitted) == 8
    book.schedule(3)                                                    # 2 rows left: not a step
    assert book.last_step == 2 and len(submitted) == 8
    book.schedule(2, n=3)                                               # a replacement goes on past the end
    assert len(submitted) == 11 and submitted[-1].endswith("@1")


def test_data_too_small_for_one_step_is_an_error():
    import pytest
    from job_fakes import prompts as make_prompts

    from services.job.prompt_book import PromptBook
    from services.data.prompt_source import PromptSource

    book = PromptBook(PromptSource(make_prompts(3), seed=0, max_epochs=1), lambda reqs: None, per_step=4,
                      last_step=5, max_age=1)
    with pytest.raises(ValueError, match="not one step of 4 prompts"):
        book.schedule(1)
