"""The store at fleet scale, sans-IO: the label index, targeted wakes, the deadline heap.

Each change must wake only the polls it can matter to (asserted on the topics the
change names, :attr:`Store.last_wake`), matching must give exactly what the old
exhaustive matcher gave, and timers must fire exactly when the old scan of every
host would have fired them.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rc_worker.controller.matching import LabelIndex, brute_force
from rc_worker.controller.messages import DeviceReport, LabelsUpdate, SheetsUpdate
from rc_worker.controller.pending import explain
from rc_worker.controller.state import ANY, host_topic, job_topic
from rc_worker.controller.store import Store, StoreConfig
from rc_worker.controller.timers import Deadlines
from rc_worker.core.selectors import Selector, Term, parse_selector

from .storekit import assign, heartbeat, register, start

# --- the label index ------------------------------------------------------------------------

KEYS = ["product", "mem", "zone", "gpu0.product", "host"]
VALUES = ["H100", "A100", "80G", "80000000000", "81920Mi", "a", "b", "1", "01", "x y"]
OPS = ["=", "!=", ">=", "<=", ">", "<"]

views = st.dictionaries(
    st.tuples(st.sampled_from(["h1", "h2", "h3"]), st.sampled_from(["g0", "g1", "g2"])),
    st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=4),
    max_size=9,
)
NUMBERS = ["80G", "80000000000", "81920Mi", "1", "01"]
terms = st.one_of(
    st.tuples(st.sampled_from(KEYS), st.sampled_from(["=", "!="]), st.sampled_from(VALUES)),
    st.tuples(st.sampled_from(KEYS), st.sampled_from(OPS[2:]), st.sampled_from(NUMBERS)),
)
selectors = st.lists(terms, max_size=3).map(
    lambda ts: parse_selector(",".join(f"{k}{op}{v}" for k, op, v in ts))
)


@settings(max_examples=300, deadline=None)
@given(first=views, second=views, selector=selectors)
def test_indexed_candidates_equal_brute_force_through_label_changes(
    first: dict[tuple[str, str], dict[str, str]],
    second: dict[tuple[str, str], dict[str, str]],
    selector: Selector,
) -> None:
    index = LabelIndex()
    for addr, view in first.items():
        index.update(addr, view)
    assert index.candidates(selector) == brute_force(first, selector)
    # Labels change: some devices leave, others get new views.
    for addr in first:
        if addr not in second:
            index.remove(addr)
    for addr, view in second.items():
        index.update(addr, view)
    assert index.candidates(selector) == brute_force(second, selector)


def test_index_epoch_moves_only_when_a_view_changes() -> None:
    index = LabelIndex()
    assert index.update(("h", "g"), {"a": "1"})
    epoch = index.epoch
    assert not index.update(("h", "g"), {"a": "1"})
    assert index.epoch == epoch
    assert index.update(("h", "g"), {"a": "2"})
    assert index.epoch == epoch + 1
    term = Term("a", "=", "1", None)
    assert index.candidates(Selector((term,))) == set()


def _fleet(store: Store, spec: dict[str, dict[str, dict[str, str]]]) -> dict[str, str]:
    sessions = {}
    for host, devices in spec.items():
        sessions[host] = register(
            store,
            host,
            list(devices),
            labels=LabelsUpdate(devices={n: dict(f) for n, f in devices.items()}),
        )
    return sessions


fleets = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.dictionaries(
        st.sampled_from(["g0", "g1"]),
        st.dictionaries(st.sampled_from(["product", "mem"]), st.sampled_from(VALUES), max_size=2),
        min_size=1,
        max_size=2,
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=100, deadline=None)
@given(
    fleet=fleets,
    jobs=st.lists(
        st.tuples(selectors, st.sampled_from([None, "a/g0", "b/g1", "c/g0"])), max_size=6
    ),
    relabel=st.dictionaries(st.sampled_from(["product", "mem"]), st.sampled_from(VALUES)),
)
def test_indexed_matching_equals_the_exhaustive_matcher(
    fleet: dict[str, dict[str, dict[str, str]]],
    jobs: list[tuple[Selector, str | None]],
    relabel: dict[str, str],
) -> None:
    store = Store()
    sessions = _fleet(store, fleet)
    for selector, pin in jobs:
        if pin is not None and pin.split("/")[1] not in fleet.get(pin.split("/")[0], {}):
            pin = None
        store.submit(["true"], select=str(selector), device=pin)
    first_host = next(iter(fleet))
    # A label change after the jobs were queued: cached candidates must follow it.
    store.put_labels(
        first_host,
        sessions[first_host],
        LabelsUpdate(host=relabel),
        now=0,
    )

    def exhaustive(host: str, name: str) -> str | None:
        h = store.known_host(host)
        assert h is not None
        view = h.devices[name].labels(h)
        for info in store.jobs("queued"):
            if info.spec.device is not None and info.spec.device != f"{host}/{name}":
                continue
            if parse_selector(info.spec.select).matches(view):
                return info.job_id
        return None

    for host, devices in fleet.items():
        for name in devices:
            expected = exhaustive(host, name)
            got = store.poll(host, sessions[host], [name], now=0)
            assert [a.job_id for a in got] == ([] if expected is None else [expected])


# --- targeted wakes --------------------------------------------------------------------------


def _three_hosts() -> tuple[Store, dict[str, str]]:
    store = Store()
    sessions = _fleet(
        store,
        {
            "a": {"g0": {"product": "A100"}, "g1": {"product": "A100"}},
            "b": {"g0": {"product": "H100"}, "g1": {"product": "H100"}},
            "c": {"g0": {"product": "L4"}},
        },
    )
    for host, devices in (("a", ["g0", "g1"]), ("b", ["g0", "g1"]), ("c", ["g0"])):
        store.open_poll(host, devices)
        # Parked: the poll found nothing to do.
        assert store.poll(host, sessions[host], devices, now=0) == []
    return store, sessions


def _woken_hosts(store: Store) -> set[str]:
    assert store.last_wake is not None, "a change that named nothing woke every poll"
    return {t.removeprefix("host/") for t in store.last_wake if t.startswith("host/")}


def test_a_new_job_wakes_one_host_that_can_run_it_and_no_other() -> None:
    store, _ = _three_hosts()
    job = store.submit(["true"], select="product=H100")
    assert _woken_hosts(store) == {"b"}
    assert store.last_wake is not None
    assert {ANY, job_topic(job)} <= store.last_wake


def test_a_burst_spreads_over_parked_devices_and_stops_when_none_is_left() -> None:
    store, sessions = _three_hosts()
    store.submit(["true"], select="product=A100")
    assert _woken_hosts(store) == {"a"}
    store.submit(["true"], select="product=A100")
    assert _woken_hosts(store) == {"a"}  # its other device
    store.submit(["true"], select="product=A100")
    assert _woken_hosts(store) == set()  # both devices of a are spoken for: nobody to wake
    # a's poll takes two of them; the third waits for a device it matches.
    got = store.poll("a", sessions["a"], ["g0", "g1"], now=0)
    assert len(got) == 2


def test_a_job_nobody_can_run_wakes_no_poll() -> None:
    store, _ = _three_hosts()
    store.submit(["true"], select="product=V100")
    assert _woken_hosts(store) == set()


def test_a_pinned_job_wakes_only_its_host() -> None:
    store, _ = _three_hosts()
    store.submit(["true"], device="c/g0")
    assert _woken_hosts(store) == {"c"}


def test_output_wakes_only_the_jobs_followers() -> None:
    store, sessions = _three_hosts()
    job = store.submit(["true"], select="product=L4")
    a = assign(store, sessions["c"], "c", ["g0"])
    start(store, sessions["c"], a, now=0)
    store.append_output(job, a.attempt, 0, b"hello")
    assert store.last_wake == frozenset({ANY, job_topic(job)})


def test_cancel_clear_idle_and_labels_wake_only_their_host() -> None:
    store, sessions = _three_hosts()
    job = store.submit(["true"], select="product=L4")
    a = assign(store, sessions["c"], "c", ["g0"])
    start(store, sessions["c"], a, now=0)
    store.cancel(job)
    assert _woken_hosts(store) == {"c"}
    store.set_idle_behavior("a", "g1", "hold")
    assert _woken_hosts(store) == {"a"}
    store.set_host_idle_behavior("b", "drain")
    assert _woken_hosts(store) == {"b"}
    store.put_labels("a", sessions["a"], LabelsUpdate(host={"zone": "1"}), now=0)
    assert _woken_hosts(store) == {"a"}
    store.put_sheets("c", sessions["c"], SheetsUpdate(host="sheet", host_given=True), now=0)
    assert _woken_hosts(store) == {"c"}


def test_a_requeued_job_is_aimed_at_a_parked_device_again() -> None:
    store = Store(StoreConfig(report_timeout_s=5.0, heartbeat_interval_s=100.0))
    sessions = _fleet(store, {"a": {"g0": {}, "g1": {}}, "b": {"g0": {"product": "L4"}}})
    store.open_poll("a", ["g0", "g1"])
    job = store.submit(["true"], select="product!=L4")
    assert _woken_hosts(store) == {"a"}
    assert assign(store, sessions["a"], "a", ["g0"], now=0).job_id == job
    store.tick(6.0)  # never started: back in the queue
    assert store.job(job).state == "queued"
    assert _woken_hosts(store) == {"a"}
    assert store.last_wake is not None
    assert job_topic(job) in store.last_wake


def test_an_aimed_device_that_took_nothing_aims_the_queue_again() -> None:
    store = Store()
    sessions = _fleet(store, {"a": {"g0": {"product": "A100"}}, "c": {"g0": {"product": "L4"}}})
    store.open_poll("a", ["g0"])
    waiting = store.submit(["true"], select="product=L4")
    assert _woken_hosts(store) == set()  # c has no poll parked yet
    store.open_poll("c", ["g0"])  # parked (its first look found the queue as it was)
    aimed = store.submit(["true"], select="product=A100")
    assert _woken_hosts(store) == {"a"}
    store.cancel(aimed)
    # a's poll finds nothing for the device it was woken for: the queue is aimed again,
    # and the waiting job now wakes c.
    assert store.poll("a", sessions["a"], ["g0"], now=0) == []
    assert _woken_hosts(store) == {"c"}
    assert [x.job_id for x in store.poll("c", sessions["c"], ["g0"], now=0)] == [waiting]


# --- the deadline heap -----------------------------------------------------------------------


def test_deadlines_earliest_first_lazy_and_rearmed_only_earlier() -> None:
    d = Deadlines()
    d.arm(("host", "x"), 10.0)
    d.arm(("host", "y"), 5.0)
    d.arm(("host", "x"), 20.0)  # later: the earlier entry stands (lazy)
    assert d.earliest() == 5.0
    d.arm(("host", "x"), 3.0)
    assert d.due(4.0) == [("host", "x")]
    assert d.due(4.0) == []
    d.disarm(("host", "y"))
    assert d.earliest() is None
    assert len(d) == 0


@settings(max_examples=150, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.sampled_from(["h0", "h1", "h2", "h3"]), st.floats(0.5, 20.0)),
        max_size=25,
    )
)
def test_heap_timers_lose_exactly_the_hosts_the_full_scan_would(
    plan: list[tuple[str, float]],
) -> None:
    """Heartbeats at random times, a tick after each: a host is lost exactly when its
    silence passes the limit, as the old scan of every host decided."""
    cfg = StoreConfig(heartbeat_interval_s=2.0, missed_heartbeats=3)
    store = Store(cfg)
    sessions = {h: register(store, h, ["g0"], now=0.0) for h in ("h0", "h1", "h2", "h3")}
    last = dict.fromkeys(sessions, 0.0)
    lost: set[str] = set()
    now = 0.0
    for host, step in plan:
        now += step
        expected = {h for h, seen in last.items() if now >= seen + cfg.lost_after_s} | lost
        store.tick(now)
        actual = {h.host for h in store.devices() if h.host_state == "lost"}
        assert actual == expected
        lost = expected
        if host not in lost:
            heartbeat(store, sessions[host], host, now=now)
            last[host] = now
        nd = store.next_deadline()
        alive = [seen + cfg.lost_after_s for h, seen in last.items() if h not in lost]
        # Never later than the real first deadline (it may be earlier: entries are lazy).
        assert (nd is None) == (not alive)
        assert nd is None or nd <= min(alive)


def test_an_unstarted_offer_is_requeued_by_its_timer_not_by_a_scan() -> None:
    cfg = StoreConfig(report_timeout_s=5.0, heartbeat_interval_s=100.0)
    store = Store(cfg)
    s = register(store, "a", ["g0"])
    job = store.submit(["true"])
    assign(store, s, "a", ["g0"], now=1.0)
    store.tick(5.9)
    assert store.job(job).state == "assigned"
    assert store.next_deadline() == 6.0
    store.tick(6.0)
    assert store.job(job).state == "queued"
    assert store.last_wake is not None
    assert host_topic("a") in store.last_wake


@settings(max_examples=150, deadline=None)
@given(
    fleet=fleets,
    selector=selectors,
    pin=st.sampled_from([None, "a/g0", "b/g1", "c/g0", "zz/g0"]),
    shrink=st.sampled_from(["a", "b", "c"]),
    hold=st.sampled_from(["a", "b", "c"]),
    busy=st.booleans(),
)
def test_indexed_pending_reason_equals_the_reason_over_the_whole_fleet(
    fleet: dict[str, dict[str, dict[str, str]]],
    selector: Selector,
    pin: str | None,
    shrink: str,
    hold: str,
    busy: bool,
) -> None:
    """A queued job's reason, worked out over the devices the index names, is exactly the
    one worked out over every device (absent, held and busy devices included)."""
    store = Store()
    _fleet(store, fleet)
    if shrink in fleet and len(fleet[shrink]) > 1:
        # Re-registered with one device fewer: that device is absent.
        first = next(iter(fleet[shrink]))
        register(store, shrink, [first], boot="boot-2")
    if hold in fleet:
        store.set_idle_behavior(hold, next(iter(fleet[hold])), "hold")
    if busy:
        store.submit(["true"])
        for host in fleet:
            h = store.known_host(host)
            assert h is not None
            ready = [n for n, d in h.devices.items() if d.present]
            if h.session is not None and store.poll(host, h.session, ready, now=0):
                break
    expected = explain(selector, pin, store._candidates())
    assert store._explain(selector, pin) == expected


@settings(max_examples=25, deadline=None)
@given(held=st.sets(st.integers(0, 159)), lost=st.sets(st.integers(0, 19), max_size=3))
def test_a_large_fleets_pending_reason_equals_the_reason_over_the_whole_fleet(
    held: set[int], lost: set[int]
) -> None:
    """Past MAX_COUNTED matching devices the store stops counting free ones early; the
    reason is still exactly explain()'s over every device."""
    store = Store(StoreConfig(heartbeat_interval_s=1.0, missed_heartbeats=1))
    for i in range(20):
        register(store, f"h{i:02d}", [f"g{k}" for k in range(8)], now=0.0 if i in lost else 5.0)
    store.tick(5.5)  # the hosts registered at 0 are lost
    for n in sorted(held):
        store.set_idle_behavior(f"h{n // 8:02d}", f"g{n % 8}", "hold")
    selector = parse_selector("device!=none")
    assert store._explain(selector, None) == explain(selector, None, store._candidates())


# --- what a heartbeat or a poll marks to be stored --------------------------------------------


def test_an_unchanged_heartbeat_or_an_empty_poll_marks_nothing_to_store() -> None:
    """At 1,000 hosts, heartbeats alone are 100 a second: one that changes nothing stored must
    cost no commit (nor the answer wait for one)."""
    store = Store(StoreConfig())
    store.journal.enable()
    session = register(store, "box1", ["gpu0", "gpu1"])
    idle = {"gpu0": DeviceReport(state="idle"), "gpu1": DeviceReport(state="idle")}
    heartbeat(store, session, devices=idle)
    store.journal.take()
    generation = store.journal.generation
    heartbeat(store, session, now=1, devices=idle)
    assert store.poll("box1", session, ["gpu0", "gpu1"], now=1) == []
    store.cancels_for("box1", session)
    assert store.journal.generation == generation
    marks, _ = store.journal.take()
    assert not marks

    # What the worker says of its devices is stored: a change in it is marked.
    heartbeat(store, session, now=2, devices={**idle, "gpu1": DeviceReport(state="busy")})
    marks, _ = store.journal.take()
    assert marks.hosts == {"box1"}
    heartbeat(store, session, now=3, devices={**idle, "gpu0": DeviceReport("idle", ("f-1",))})
    marks, _ = store.journal.take()
    assert marks.hosts == {"box1"}


def test_a_poll_that_assigns_marks_the_job_and_the_host() -> None:
    store = Store(StoreConfig())
    store.journal.enable()
    session = register(store, "box1", ["gpu0"])
    job_id = store.submit(["true"])
    store.journal.take()
    a = assign(store, session)
    marks, _ = store.journal.take()
    assert a.job_id == job_id
    assert job_id in marks.jobs
    assert marks.hosts == {"box1"}  # the device's last job is stored with the host
    start(store, session, a)
    marks, _ = store.journal.take()
    assert job_id in marks.jobs
    assert marks.hosts == {"box1"}  # the other session calls mark their host as before
