"""Same-model-first scheduling (issue 35 item 3): the queue may run a waiting job of the
model that ran last before older ones, to save a swap, but passes a waiting job over at
most ``max_reorder`` times."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_offload.server.jobs import Job, JobManager


def _run(models: list[str], max_reorder: int) -> tuple[list[str], dict[str, int]]:
    """The order ``models`` (one job each, queued while the first runs) run in, and how
    often each waiting job was passed over."""
    gate = threading.Event()
    ran: list[str] = []

    def runner(job: Job) -> None:
        if not ran:
            gate.wait(10)  # the others queue while the first runs
        ran.append(job.payload)

    jobs = JobManager(runner, max_queue=100, group_of=lambda job: job.payload, max_reorder=max_reorder)
    jobs.start()
    queued = [Job("image", m) for m in models]
    names = {id(j): f"{j.payload}{i}" for i, j in enumerate(queued)}
    jobs.submit(queued[0])
    while jobs.running_count == 0:
        threading.Event().wait(0.001)
    for job in queued[1:]:
        jobs.submit(job)
    gate.set()
    for _ in range(10_000):
        if all(j.finished for j in queued):
            break
        threading.Event().wait(0.001)
    jobs.shutdown(1.0)
    assert all(j.status == "completed" for j in queued)
    return ran, {names[id(j)]: j.passed_over for j in queued}


def test_the_model_that_ran_last_goes_first_within_the_bound():
    order, passed = _run(["a", "b", "a", "b", "a", "a"], max_reorder=2)
    # after a: the waiting a's run first; b1 is passed over twice, then it must run
    assert order == ["a", "a", "a", "b", "b", "a"]
    assert max(passed.values()) <= 2 and passed["b1"] == 2


def test_no_reordering_is_fifo():
    order, passed = _run(["a", "b", "a", "b"], max_reorder=0)
    assert order == ["a", "b", "a", "b"] and set(passed.values()) == {0}


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from("abc"), min_size=2, max_size=12), st.integers(0, 4))
def test_no_job_is_passed_over_more_than_the_bound(models, bound):
    order, passed = _run(models, bound)
    assert sorted(order) == sorted(models)
    assert max(passed.values()) <= bound


def test_max_reorder_must_be_a_count():
    with pytest.raises(ValueError, match="max_reorder must be an integer >= 0"):
        JobManager(lambda job: None, max_queue=1, max_reorder=-1)
