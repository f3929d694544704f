"""kvbatch.jobs.local.eta against a simulated continuously batching engine (tests/jobs/
simulated_engine.py): its true time left is known at every step, so each estimate is judged
against it, and against the old requests-done-over-time formula it replaces."""

from __future__ import annotations

import math

import pytest

from kvbatch.jobs.local.eta import EtaEstimator, JobWork, format_eta
from tests.jobs.simulated_engine import FakeClock, SimulatedEngine

RATE = 1000.0  # tokens a second


def run_job(prompts, outputs, concurrency, caps=None):
    """Run the simulation; yields (requests done, true seconds left, our estimate, the old
    formula's) at every finished request."""
    clock = FakeClock()
    engine = SimulatedEngine(prompts, outputs, concurrency, RATE, clock)
    caps = caps or [256] * len(outputs)
    work = JobWork(sum(prompts), 0, caps, [1] * len(outputs))
    eta = EtaEstimator(work, engine.stats(), clock)
    for done, out in enumerate(engine.run(), 1):
        eta.finished(out.request_id, len(out.outputs[0].token_ids))
        old = (len(prompts) - done) * clock.now / done
        yield done, engine.seconds_left(), eta.seconds_left(engine.stats()), old


def test_the_first_eta_is_close_where_done_over_elapsed_is_concurrency_times_off():
    concurrency = 8
    done, true, new, old = next(run_job([100] * 64, [50] * 64, concurrency))
    assert done == 1 and true > 0
    assert old > concurrency * true  # what users saw: "ETA 774 s" for a 143 s job
    assert new == pytest.approx(true, rel=0.25)


def test_equal_outputs_are_estimated_exactly_throughout():
    """Up to the floor of a token per request not reported finished yet (the last step's
    outputs arrive one by one)."""
    for _, true, new, _ in run_job([100] * 64, [50] * 64, 8):
        assert new == pytest.approx(true, rel=1e-9, abs=8 / RATE)


def test_different_output_lengths_start_low_and_converge():
    """The first to finish are the shortest of their window, so the first estimate is low;
    it still beats the old formula by far, and closes in as longer answers finish. (In the
    last stretch the requests still running are the long ones, which the mean underrates:
    a small error in seconds, large next to the little time left.)"""
    n = 200
    outputs = [10 + (i * 37) % 200 for i in range(n)]
    estimates = list(run_job([300] * n, outputs, 16))
    _, true, new, old = estimates[0]
    assert new == pytest.approx(true, rel=0.35)
    assert old > 10 * true
    job_seconds = (300 * n + sum(outputs) - n) / RATE
    for done, true, new, _ in estimates[n // 4 :]:
        assert abs(new - true) <= 0.1 * true + 0.01 * job_seconds, f"after {done} requests"


def test_an_unfinished_request_is_expected_no_longer_than_its_cap():
    clock = FakeClock()
    # two requests of 10-token prompts: one may write 100 tokens, the other at most 4
    work = JobWork(prompt_tokens=20, cached_tokens=0, max_tokens=[100, 4], choices=[1, 1])
    eta = EtaEstimator(work, Counts(0, 0), clock)
    clock.now = 1.0
    eta.finished("0", 100)
    # computed: request 0 (10 + 99), request 1's prompt and 3 tokens (10 + 3): 122 in 1 s
    # left: 20 + (100 + min(100, 4)) - 2 - 122 = 0, but at least one token (one unfinished)
    assert eta.seconds_left(Counts(122, 104)) == pytest.approx(1 / 122)
    # with a cap of 100 the mean (100) would stand: 96 tokens more
    work = JobWork(20, 0, [100, 100], [1, 1])
    eta = EtaEstimator(work, Counts(0, 0), clock := FakeClock())
    clock.now = 1.0
    eta.finished(0, 100)
    assert eta.seconds_left(Counts(122, 104)) == pytest.approx(96 / 122)


def test_choices_and_cached_prompt_tokens_count():
    clock = FakeClock()
    # request 0 (n=2) finished with 2 x 30 tokens; request 1 (n=3) is expected to write 3 x 30
    work = JobWork(prompt_tokens=100, cached_tokens=40, max_tokens=[64, 64], choices=[2, 3])
    eta = EtaEstimator(work, Counts(1000, 500), clock)  # the engine ran other work before
    clock.now = 2.0
    eta.finished("0", 60)
    # job work: 100 - 40 + (60 + 90) - 5 = 205; computed so far 100 (in 2 s): 105 left
    assert eta.seconds_left(Counts(1100, 560)) == pytest.approx(105 / 50)


def test_output_already_generated_is_a_floor_for_the_expected_output():
    """In-flight requests that wrote more than the finished mean predicts."""
    clock = FakeClock()
    work = JobWork(prompt_tokens=0, cached_tokens=0, max_tokens=[500] * 3, choices=[1] * 3)
    eta = EtaEstimator(work, Counts(0, 0), clock)
    clock.now = 1.0
    eta.finished("0", 10)
    # the mean says 30 tokens in all, but 250 are written already: 250 - 3 - 200 computed
    assert eta.seconds_left(Counts(200, 250)) == pytest.approx(47 / 200)


def test_the_rate_comes_from_the_recent_window():
    """A slow start (a prefill-heavy first minute, say) stops counting once a window has
    passed."""
    clock = FakeClock()
    work = JobWork(prompt_tokens=10**6, cached_tokens=0, max_tokens=[0], choices=[0])
    eta = EtaEstimator(work, Counts(0, 0), clock, window_seconds=60.0)
    computed = 0
    for second in range(1, 181):  # 100 tokens/s for a minute, then 1000 tokens/s
        computed += 100 if second <= 60 else 1000
        clock.now = float(second)
        left = eta.seconds_left(Counts(computed, 0))
        if second == 60:
            assert left == pytest.approx((10**6 - computed) / 100)
    assert left == pytest.approx((10**6 - computed) / 1000)


def test_embeddings_have_an_estimate_before_any_finishes():
    clock = FakeClock()
    work = JobWork(prompt_tokens=1000, cached_tokens=0, max_tokens=[0] * 4, choices=[0] * 4)
    eta = EtaEstimator(work, Counts(0, 0), clock)
    clock.now = 1.0
    assert eta.seconds_left(Counts(250, 0)) == pytest.approx(3.0)


def test_no_estimate_before_a_request_finishes_or_any_work_or_time_passes():
    clock = FakeClock()
    work = JobWork(prompt_tokens=100, cached_tokens=0, max_tokens=[16] * 4, choices=[1] * 4)
    eta = EtaEstimator(work, Counts(0, 0), clock)
    assert eta.seconds_left(Counts(0, 0)) is None  # no time has passed
    clock.now = 1.0
    assert eta.seconds_left(Counts(0, 0)) is None  # no work either
    assert eta.seconds_left(Counts(50, 2)) is None  # work, but no output length known yet
    eta.finished("1", 16)
    assert eta.seconds_left(Counts(60, 20)) is not None


@pytest.mark.parametrize("requests", [0, 3])
def test_a_job_with_nothing_left_is_done(requests: int):
    """Zero requests, or (--resume) every one answered already, or all finished."""
    clock = FakeClock()
    work = JobWork(0, 0, [8] * requests, [1] * requests)
    eta = EtaEstimator(work, Counts(0, 0), clock)
    for i in range(requests):
        eta.finished(str(i), 8)
    assert eta.seconds_left(Counts(0, 0)) == 0.0


def test_outputs_of_requests_not_in_the_job_are_ignored():
    clock = FakeClock()
    eta = EtaEstimator(JobWork(10, 0, [8], [1]), Counts(0, 0), clock)
    eta.finished("someone-else", 5)
    eta.finished("7", 5)
    clock.now = 1.0
    assert eta.seconds_left(Counts(10, 1)) is None  # request 0 still unfinished, nothing known


def test_job_work_of_requests():
    class Params:
        def __init__(self, max_tokens, n):
            self.max_tokens, self.n = max_tokens, n

    class Request:
        def __init__(self, params, is_pooled=False):
            self.params, self.is_pooled = params, is_pooled

    work = JobWork.of([Request(Params(16, 1)), Request(None, True), Request(Params(5, 3))], 9, 2)
    assert list(work.max_tokens) == [16, 0, 5] and list(work.choices) == [1, 0, 3]
    assert (work.prompt_tokens, work.cached_tokens) == (9, 2)
    with pytest.raises(ValueError):
        JobWork(0, 0, [1, 2], [1])


@pytest.mark.parametrize(
    "seconds, shown",
    [
        (None, "ETA ?"),
        (math.nan, "ETA ?"),
        (math.inf, "ETA ?"),
        (0.0, "ETA 0 s"),
        (94.6, "ETA 95 s"),
    ],
)
def test_format_eta(seconds, shown):
    assert format_eta(seconds) == shown


class Counts:
    def __init__(self, computed_tokens: int, generation_tokens: int, num_running: int = 0) -> None:
        self.computed_tokens, self.generation_tokens = computed_tokens, generation_tokens
        self.num_running = num_running


def test_the_estimate_is_a_lower_bound_until_the_first_cohort_has_finished():
    """The requests running when the first one finished started together; until all of them
    have finished the outputs seen are the short ones, so the estimate is marked a lower bound
    ("ETA >N s"), and it is one here."""
    n, concurrency = 120, 16
    outputs = [10 + (i * 37) % 200 for i in range(n)]
    clock = FakeClock()
    engine = SimulatedEngine([300] * n, outputs, concurrency, RATE, clock)
    eta = EtaEstimator(JobWork(300 * n, 0, [256] * n, [1] * n), engine.stats(), clock)
    assert not eta.settled
    seen = []
    for done, out in enumerate(engine.run(), 1):
        eta.finished(out.request_id, len(out.outputs[0].token_ids))
        left = eta.seconds_left(engine.stats())
        seen.append((done, eta.settled))
        if not eta.settled:
            assert left <= engine.seconds_left()
    first_settled = next(done for done, settled in seen if settled)
    assert concurrency // 2 <= first_settled <= concurrency
    assert all(settled for done, settled in seen if done >= first_settled)
    assert format_eta(12.4, lower_bound=True) == "ETA >12 s"
