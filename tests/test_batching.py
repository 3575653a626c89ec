"""The dynamic batcher: its thread (and the torch thread count set on it), and when it waits."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from dflash_serve.batching import DynamicBatcher
from dflash_serve.errors import ConfigError
from dflash_serve.speculative.types import SamplingParams
from drafter_service.engine import DrafterEngine
from drafter_service.model.loader import load_drafter
from drafter_service.session import InProcessDrafter
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget


def test_initializer_runs_once_on_the_thread_that_runs_batches():
    seen = []
    batcher = DynamicBatcher(
        lambda requests: [threading.current_thread().name for _ in requests],
        4,
        0,
        "probe",
        lambda: seen.append(threading.current_thread().name),
    )

    async def go():
        return [await batcher.submit(i) for i in range(3)]

    names = asyncio.run(go())
    batcher.close()
    assert len(seen) == 1
    assert names == seen * 3
    assert seen[0] != threading.current_thread().name


def test_target_engine_thread_uses_the_configured_thread_count(causal_lm_dir):
    engine = TargetEngine(load_target_model(causal_lm_dir), StateShape(1, 32))
    main_threads = torch.get_num_threads()
    target = InProcessTarget(engine, engine_threads=1)

    async def engine_threads():
        return await target.batcher.run_exclusive(torch.get_num_threads)

    assert asyncio.run(engine_threads()) == 1
    target.close()
    assert torch.get_num_threads() == main_threads  # this thread keeps its own setting


MAX_WAIT_US = 3_000_000  # long: every test below that would wait this long fails by timing out


def run_submissions(batcher, submissions, timeout_s=2.0):
    """Submit (delay_s, request) pairs from concurrent tasks; the batches, in order."""

    async def submit_after(delay_s, request):
        await asyncio.sleep(delay_s)
        return await batcher.submit(request)

    async def go():
        tasks = [submit_after(delay, request) for delay, request in submissions]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)

    try:
        asyncio.run(go())
    finally:
        batcher.close()


def recording_batcher(batches, num_possible, **options):
    def run_batch(requests):
        batches.append(sorted(requests))
        return list(requests)

    return DynamicBatcher(run_batch, 8, MAX_WAIT_US, "wait", None, num_possible, **options)


def test_a_lone_session_does_not_wait_for_companions():
    batches = []
    batcher = recording_batcher(batches, lambda: 1)
    run_submissions(batcher, [(0, "only")])
    assert batches == [["only"]]
    assert batcher.counters.total_wait_us < 100_000


def test_the_time_batches_wait_for_companions_is_counted():
    batches = []
    batcher = recording_batcher(batches, lambda: 2)
    run_submissions(batcher, [(0, "a"), (0.2, "b")])
    assert batches == [["a", "b"]]
    assert 150_000 <= batcher.counters.total_wait_us <= MAX_WAIT_US


def test_a_request_waits_for_the_other_open_sessions_and_no_longer():
    """Three open sessions: the batch runs once the third request is in, long before
    max_wait_us (a fixed sleep of max_wait_us would time out)."""
    batches = []
    submissions = [(0, "a"), (0.05, "b"), (0.1, "c")]
    run_submissions(recording_batcher(batches, lambda: 3), submissions)
    assert batches == [["a", "b", "c"]]


def test_without_a_session_count_the_batcher_waits_out_max_wait():
    batches = []
    batcher = DynamicBatcher(lambda r: batches.append(list(r)) or list(r), 8, 100_000, "wait")
    run_submissions(batcher, [(0, "a"), (0.02, "b")])
    assert batches == [["a", "b"]]


def test_requests_arriving_during_a_batch_wait_for_the_sessions_still_out():
    """Sessions a, b, c: a and b arrive while c's batch runs, c comes back later; a and b
    wait for it instead of running as a batch of their own (which would keep the sessions
    in two groups that never share a batch again)."""
    batches = []
    started = threading.Event()

    def run_batch(requests):
        batches.append(sorted(r[0] for r in requests))
        if batches == [["c"]]:
            started.set()
            threading.Event().wait(0.1)  # a and b arrive meanwhile
        return list(requests)

    batcher = DynamicBatcher(
        run_batch, 8, MAX_WAIT_US, "wait", None, lambda: 3, session_of=lambda r: r[0]
    )

    async def go():
        async def session(name, delays):
            for delay in delays:
                await asyncio.sleep(delay)
                await batcher.submit((name, delay))

        await asyncio.wait_for(
            asyncio.gather(session("c", [0, 0.05]), session("a", [0.02]), session("b", [0.02])),
            2.0,
        )

    try:
        asyncio.run(go())
    finally:
        batcher.close()
    assert started.is_set()
    assert batches == [["c"], ["a", "b", "c"]]


def test_a_session_silent_for_longer_than_recent_s_is_not_waited_for():
    batches = []
    batcher = recording_batcher(
        batches, lambda: 2, session_of=lambda request: request[0], recent_s=0.05
    )
    run_submissions(batcher, [(0, ("idle", 1)), (0.2, ("busy", 1)), (0.25, ("busy", 2))])
    assert batches == [[("idle", 1)], [("busy", 1)], [("busy", 2)]]


def test_requests_still_arriving_keep_a_gapped_wait_going_past_the_gap():
    """Four sessions' requests 50 ms apart with a 120 ms gap: each arrival extends the wait,
    so all four share a batch though the last comes 150 ms after the first."""
    batches = []
    batcher = recording_batcher(batches, lambda: 4, max_gap_us=120_000)
    run_submissions(batcher, [(0, "a"), (0.05, "b"), (0.1, "c"), (0.15, "d")])
    assert batches == [["a", "b", "c", "d"]]


def test_a_pause_longer_than_the_gap_ends_the_wait():
    """Three open sessions, two requests, then a pause: the two run after the gap (long
    before max_wait_us) and the third, later, on its own."""
    batches = []
    batcher = recording_batcher(batches, lambda: 3, max_gap_us=50_000)
    run_submissions(batcher, [(0, "a"), (0.02, "b"), (0.5, "c")])
    assert batches == [["a", "b"], ["c"]]
    waited_us = batcher.counters.total_wait_us
    assert 60_000 <= waited_us <= 400_000  # gap after b (~70 ms), not max_wait_us (3 s)


def test_a_gapped_wait_counts_from_the_batch_start_for_requests_that_came_during_a_batch():
    """b arrives while a's 150 ms batch runs; its wait starts when that batch ends, not when
    b came (already more than a gap ago), so c, 20 ms later, joins it."""
    batches = []

    def run_batch(requests):
        batches.append(sorted(requests))
        if requests == ["a"]:
            time.sleep(0.15)
        return list(requests)

    batcher = DynamicBatcher(run_batch, 8, MAX_WAIT_US, "gap", None, lambda: 3, max_gap_us=50_000)
    run_submissions(batcher, [(0, "a"), (0.1, "b"), (0.22, "c")])
    assert batches == [["a"], ["b", "c"]]


def test_a_gapped_wait_waits_for_a_session_still_opening():
    """The open takes three gaps; the early prompt waits for it and for the prompt that
    follows it (an open's end counts as an arrival)."""
    batches, open_sessions = [], {"early"}

    def slow_open():
        time.sleep(0.15)
        open_sessions.add("late")
        return "late"

    batcher = recording_batcher(
        batches,
        lambda: len(open_sessions),
        session_of=lambda r: r[0],
        recent_s=10.0,  # (an opening session is otherwise waited for 0.1 s at most)
        max_gap_us=50_000,
    )

    async def late_prompt():
        session = await batcher.open_session(slow_open, print)
        await asyncio.sleep(0.02)  # the open's answer reaches the client, which sends
        return await batcher.submit((session, "prompt"))

    run_concurrently(batcher, batcher.submit(("early", "prompt")), late_prompt())
    assert batches == [[("early", "prompt"), ("late", "prompt")]]


def test_a_negative_gap_is_refused():
    with pytest.raises(ValueError, match="max_gap_us"):
        DynamicBatcher(list, 8, 1000, "bad", max_gap_us=0)  # 0 would mean no wait at all


def test_the_max_gap_flag_reaches_the_drafter_services_batcher(dflash_dir, causal_lm_dir):
    from drafter_service.config import DrafterServiceConfig
    from drafter_service.runtime import DrafterRuntime
    from launcher.main import build_parser, service_settings

    flags = ["drafter", "--model", str(dflash_dir), "--target-model", str(causal_lm_dir)]
    settings = service_settings(build_parser().parse_args([*flags, "--max-gap-us", "400"]))
    runtime = DrafterRuntime(DrafterServiceConfig(str(dflash_dir), str(causal_lm_dir), settings))
    try:
        assert runtime.drafter.batcher.max_gap_s == pytest.approx(400e-6)
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="max_gap_us"):
        replace(settings, max_gap_us=0).validate("drafter")


async def after(delay_s, fn, *args):
    await asyncio.sleep(delay_s)
    result = fn(*args)
    return await result if asyncio.iscoroutine(result) else result


def run_concurrently(batcher, *coroutines, timeout_s=2.0):
    async def go():
        await asyncio.wait_for(asyncio.gather(*coroutines), timeout_s)

    try:
        asyncio.run(go())
    finally:
        batcher.close()


def test_a_session_closing_ends_the_others_wait():
    """b waits for a (recently served); a closes: b runs then, not after max_wait_us."""
    batches = []
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=10.0)
    run_concurrently(
        batcher,
        batcher.submit(("a", 1)),
        after(0.05, batcher.submit, ("b", 1)),
        after(0.1, batcher.forget, "a"),
    )
    assert batches == [[("a", 1)], [("b", 1)]]


def test_a_session_going_stale_during_the_wait_ends_it():
    batches = []
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=0.2)
    run_concurrently(batcher, batcher.submit(("a", 1)), after(0.05, batcher.submit, ("b", 1)))
    assert batches == [[("a", 1)], [("b", 1)]]


def test_first_requests_wait_for_sessions_expected_to_send_theirs():
    """a, b and c opened (expected to send a first request); a's and b's first requests
    come 0.1 s apart and share a batch, which runs once c's has come too, long before
    max_wait_us. Without the expectation a's would have run alone."""
    batches = []
    batcher = recording_batcher(batches, lambda: 3, session_of=lambda r: r[0], recent_s=10.0)
    for session in "abc":
        batcher.expect_first_request(session)
    run_submissions(batcher, [(0, ("a", 1)), (0.1, ("b", 1)), (0.2, ("c", 1))])
    assert batches == [[("a", 1), ("b", 1), ("c", 1)]]


def test_a_first_request_runs_alone_without_the_expectation():
    """(b's then waits for a, served a moment ago, until a goes stale after recent_s.)"""
    batches = []
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=0.05)
    run_submissions(batcher, [(0, ("a", 1)), (0.1, ("b", 1))])
    assert batches == [[("a", 1)], [("b", 1)]]


def test_a_batch_holding_a_later_request_does_not_wait_for_expected_sessions():
    """b is expected and stays silent. a (never expected) runs its requests at once, and so
    does c's first request, pending beside a's later one: only a batch made of first
    requests waits for b. A close of b (forget) ends a first request's wait."""
    batches = []
    batcher = recording_batcher(batches, lambda: 4, session_of=lambda r: r[0], recent_s=0.05)
    batcher.expect_first_request("b")
    batcher.expect_first_request("c")
    began = time.monotonic()
    run_concurrently(
        batcher,
        batcher.submit(("a", 1)),
        after(0.1, batcher.submit, ("a", 2)),
        after(0.1, batcher.submit, ("c", 1)),
        after(0.2, batcher.submit, ("d", 1)),
    )
    assert batches == [[("a", 1)], [("a", 2), ("c", 1)], [("d", 1)]]
    assert time.monotonic() - began < 1.0  # max_wait_us is 3 s
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=10.0)
    for session in "ef":
        batcher.expect_first_request(session)
    began = time.monotonic()
    run_concurrently(batcher, batcher.submit(("e", 1)), after(0.1, batcher.forget, "f"))
    assert batches[-1] == [("e", 1)]
    assert time.monotonic() - began < 1.0


def test_an_expected_session_that_stays_silent_costs_a_first_request_max_wait_us():
    batches = []
    batcher = DynamicBatcher(
        lambda r: batches.append(list(r)) or list(r), 8, 200_000, "wait", None, lambda: 2,
        session_of=lambda r: r[0], recent_s=10.0,
    )  # fmt: skip
    batcher.expect_first_request("a")
    batcher.expect_first_request("b")
    began = time.monotonic()
    run_submissions(batcher, [(0, ("a", 1))])
    assert batches == [[("a", 1)]]
    assert 0.2 <= time.monotonic() - began < 1.0


def test_drafter_sessions_starting_together_share_their_first_draft(causal_lm_dir, dflash_dir):
    """The drafter service's sessions expect their first drafts from their open: two opened
    together whose first drafts come 50 ms apart run them in one batch."""
    engine = DrafterEngine(load_drafter(dflash_dir, causal_lm_dir), 2, 64)
    owner = InProcessDrafter(engine, max_wait_us=MAX_WAIT_US)
    features = torch.zeros(3, engine.feature_dim)

    async def go():
        first, second = await asyncio.gather(owner.open(), owner.open())
        await asyncio.gather(first.draft(features, 1, 4), after(0.05, second.draft, features, 2, 4))
        await first.close()
        await second.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 5.0))
    finally:
        owner.close()
    assert (owner.batcher.counters.num_batches, owner.batcher.counters.num_requests) == (1, 2)


def open_then_submit(batcher, name, delay_s):
    """A session as a client runs it: open (on the batcher's thread), then its first request
    `delay_s` later (the client's round trips)."""

    async def go():
        session = await batcher.open_session(lambda: name, print)
        await asyncio.sleep(delay_s)
        return await batcher.submit((session, "prompt"))

    return go()


def test_sessions_opening_together_meet_in_one_batch():
    """b's open returns at once but its prompt comes 0.1 s after a's: a's prompt waits for it
    (a just-opened session counts as recently served), and no longer (max_wait_us is 3 s)."""
    batches = []
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=10.0)
    run_concurrently(
        batcher, open_then_submit(batcher, "a", 0), open_then_submit(batcher, "b", 0.1)
    )
    assert batches == [[("a", "prompt"), ("b", "prompt")]]


def test_a_session_still_opening_is_waited_for():
    """b's open is still on the thread (a slow one) when a's prompt arrives, so the open
    sessions are one: a waits for b all the same."""
    batches, opened = [], []
    batcher = recording_batcher(
        batches, lambda: len(opened), session_of=lambda r: r[0], recent_s=10.0
    )

    def open_a():
        opened.append("a")
        return "a"

    def open_b():
        time.sleep(0.1)
        opened.append("b")
        return "b"

    async def a():
        session = await batcher.open_session(open_a, print)
        await asyncio.sleep(0.03)  # b is opening by now
        return await batcher.submit((session, "prompt"))

    async def b():
        await asyncio.sleep(0.01)  # after a's open
        session = await batcher.open_session(open_b, print)
        return await batcher.submit((session, "prompt"))

    run_concurrently(batcher, a(), b())
    assert batches == [[("a", "prompt"), ("b", "prompt")]]


def test_work_outside_the_queue_goes_after_the_requests_pending_for_it():
    """a's prompt waits for b (just opened); b's next work is a long job outside the batch
    queue (a long prompt): a's batch stops waiting and runs first, not behind the job on the
    thread (nor after max_wait_us: the 2 s timeout would fail the test)."""
    events = []

    def run_batch(requests):
        events.append(("batch", sorted(r[0] for r in requests)))
        return list(requests)

    batcher = DynamicBatcher(
        run_batch, 8, MAX_WAIT_US, "wait", None, lambda: 2, session_of=lambda r: r[0]
    )

    def long_job():
        events.append(("job", "b"))
        time.sleep(0.1)

    async def b():
        session = await batcher.open_session(lambda: "b", print)
        await asyncio.sleep(0.05)  # a's prompt is waiting for b by now
        await batcher.run_exclusive_for(session, long_job)

    run_concurrently(batcher, open_then_submit(batcher, "a", 0), b())
    assert events == [("batch", ["a"]), ("job", "b")]


def test_a_failed_open_is_not_waited_for():
    batches = []
    batcher = recording_batcher(batches, lambda: 2, session_of=lambda r: r[0], recent_s=10.0)

    def failing_open():
        time.sleep(0.05)
        raise RuntimeError("no slot")

    async def b():
        with pytest.raises(RuntimeError, match="no slot"):
            await batcher.open_session(failing_open, print)

    run_concurrently(batcher, open_then_submit(batcher, "a", 0.01), b())
    assert batches == [[("a", "prompt")]]


def test_a_session_whose_opener_is_cancelled_is_closed():
    """The client goes away while its open runs on the thread: the session that open took is
    closed there, right after; an open whose opener waited for it is not."""
    batcher = recording_batcher([], lambda: 2, session_of=lambda r: r[0])
    opening, closed = threading.Event(), []

    def slow_open():
        opening.wait(2.0)
        return "a"

    async def go():
        cancelled = asyncio.ensure_future(batcher.open_session(slow_open, closed.append))
        await asyncio.sleep(0.05)  # slow_open runs by now
        cancelled.cancel()
        opening.set()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        kept = await batcher.open_session(lambda: "b", closed.append)
        await batcher.run_exclusive(lambda: None)  # after any close queued for a or b
        return kept

    try:
        assert asyncio.run(asyncio.wait_for(go(), 2.0)) == "b"
    finally:
        batcher.close()
    assert closed == ["a"]


def gated_open(engine, gate: threading.Event, started: threading.Event, opened: list) -> None:
    """Make the engine's opens wait for `gate` (on the engine thread); `opened` gets the
    slots they took."""
    open_sequence = engine.open_sequence

    def open_when_let():
        started.set()
        gate.wait(2.0)
        opened.append(open_sequence())
        return opened[-1]

    engine.open_sequence = open_when_let


@pytest.mark.parametrize("service", ["target", "drafter"])
def test_a_service_session_whose_client_left_during_its_open_frees_its_slot(
    service, causal_lm_dir, dflash_dir
):
    """One slot: the client of the first open is cancelled while its open runs; the slot it
    took is freed on the thread right after (it stayed taken before: the wait times out),
    and the next session gets it."""
    if service == "target":
        engine = TargetEngine(load_target_model(causal_lm_dir), StateShape(1, 32))
        owner, open_args = InProcessTarget(engine), (SamplingParams(),)
    else:
        engine = DrafterEngine(load_drafter(dflash_dir, causal_lm_dir), 1, 32)
        owner, open_args = InProcessDrafter(engine), ()
    gate, started, opened = threading.Event(), threading.Event(), []
    gated_open(engine, gate, started, opened)

    async def go():
        left = asyncio.ensure_future(owner.open(*open_args))
        while not started.is_set():
            await asyncio.sleep(0.01)
        left.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await left
        while not opened or engine.slots.num_active:  # the open ends, then the close runs
            await asyncio.sleep(0.01)
        session = await owner.open(*open_args)
        await session.close()
        return session.slot

    try:
        assert asyncio.run(asyncio.wait_for(go(), 5.0)) == 0
    finally:
        owner.close()
    assert engine.slots.num_active == 0


def test_closing_during_a_batch_on_the_thread_leaves_no_waiter_hanging():
    """close() while a batch runs on the thread: its waiter is cancelled once the batch's
    thread work ends (before, the batch had left the queue and its waiter hung)."""
    started, gate = threading.Event(), threading.Event()

    def run_batch(requests):
        started.set()
        gate.wait(2.0)
        return list(requests)

    batcher = DynamicBatcher(run_batch, 8, 0, "close")

    async def go():
        waiter = asyncio.ensure_future(batcher.submit("a"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        threading.Timer(0.1, gate.set).start()
        batcher.close()  # waits for the thread's work, then the worker is cancelled
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 1.0)

    asyncio.run(go())


def test_a_batch_with_the_wrong_number_of_results_fails_its_requests():
    batcher = DynamicBatcher(lambda requests: [], 8, 0, "broken")

    async def go():
        with pytest.raises(RuntimeError, match="got 0 results"):
            await asyncio.wait_for(batcher.submit("x"), 2.0)

    try:
        asyncio.run(go())
    finally:
        batcher.close()


def test_inline_batches_run_on_the_event_loop_while_the_thread_is_idle():
    batcher = DynamicBatcher(
        lambda requests: [threading.current_thread().name for _ in requests],
        4, 0, "inline-probe", inline_batches=True,
    )  # fmt: skip

    async def go():
        return [await batcher.submit(i) for i in range(3)], threading.current_thread().name

    names, loop_thread = asyncio.run(go())
    batcher.close()
    assert names == [loop_thread] * 3
    assert batcher.counters.num_inline_batches == 3


@pytest.mark.parametrize("cancel_the_waiter", [False, True])
def test_an_inline_batch_never_overlaps_work_on_the_thread(cancel_the_waiter):
    """A batch submitted while exclusive work runs on the thread goes to the thread, after it
    (engines are not re-entrant), even when that work's waiter was cancelled; once the thread
    is idle again, batches run inline."""
    spans, threads = [], []

    def run(requests):
        began = time.perf_counter()
        threads.append(threading.current_thread().name)
        spans.append((began, time.perf_counter()))
        return list(requests)

    def slow_exclusive():
        began = time.perf_counter()
        time.sleep(0.3)
        spans.append((began, time.perf_counter()))

    batcher = DynamicBatcher(run, 4, 0, "overlap-probe", inline_batches=True)

    async def go():
        exclusive = asyncio.ensure_future(batcher.run_exclusive(slow_exclusive))
        await asyncio.sleep(0.05)  # the slow work is running on the thread
        if cancel_the_waiter:
            exclusive.cancel()
        first = await batcher.submit("during")
        await asyncio.sleep(0.4)  # the slow work has finished
        second = await batcher.submit("after")
        return first, second, threading.current_thread().name

    first, second, loop_thread = asyncio.run(go())
    batcher.close()
    assert (first, second) == ("during", "after")
    exclusive_span, during_span = spans[0], spans[1]
    assert during_span[0] >= exclusive_span[1]  # after the exclusive work, not during it
    assert threads[0] != loop_thread and threads[1] == loop_thread
    assert batcher.counters.num_inline_batches == 1
