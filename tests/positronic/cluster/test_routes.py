"""Which replica serves a request (positronic/cluster/routes.py): pure rules, no Ray."""

import json
from collections import Counter

import pytest

from positronic.cluster.routes import NoReplica, Routes, rank, session_of

REPLICAS = ["replica-0", "replica-1", "replica-2"]


def test_the_session_is_read_as_the_server_reads_it():
    body = json.dumps({"model": "m", "user": "alice", "prompt": "hi"}).encode()
    assert session_of("/v1/completions", {}, body) == "alice"
    assert session_of("/v1/completions", {"x-session-id": "bob"}, body) == "bob"  # the header first, as the server
    assert session_of("/v1/sessions/carol", {}, b"") == "carol"
    assert session_of("/v1/completions", {}, json.dumps({"prompt": "hi"}).encode()) is None  # throwaway
    for odd in (b"", b"not json", b"[1, 2]", b'{"user": 7}', b'{"user": ""}', b"{" * 100000):
        assert session_of("/v1/completions", {}, odd) is None  # the replica answers what is wrong


def test_a_session_stays_on_its_replica_and_sessions_spread():
    routes = Routes(list(REPLICAS))
    homes = {f"s{i}": routes.pick(f"s{i}") for i in range(300)}
    for _ in range(3):
        assert all(routes.pick(sid) == home for sid, home in homes.items())
    spread = Counter(homes.values())
    assert set(spread) == set(REPLICAS) and min(spread.values()) > 60, spread  # ~100 each
    assert routes.owner == {}  # nothing written down while every replica is up
    assert Routes(list(REPLICAS)).pick("s7") == homes["s7"]  # another front (or a restarted one) agrees


def test_a_down_replicas_sessions_move_once_and_stay_when_it_returns():
    routes = Routes(list(REPLICAS))
    homes = {f"s{i}": routes.pick(f"s{i}") for i in range(60)}
    routes.fail("replica-1")
    moved = {sid: routes.pick(sid) for sid, home in homes.items() if home == "replica-1"}
    assert moved and "replica-1" not in moved.values()
    for sid, home in homes.items():  # the others did not move
        if home != "replica-1":
            assert routes.pick(sid) == home
    # each moved to its own next choice, so they spread over the replicas left
    assert all(new == [r for r in rank(sid, REPLICAS) if r != "replica-1"][0] for sid, new in moved.items())
    assert routes.moved == len(moved)
    routes.revive("replica-1")
    assert all(routes.pick(sid) == new for sid, new in moved.items())  # they stay where they are held now
    assert routes.pick("a-new-session-x") in REPLICAS
    assert "replica-1" not in routes.owner.values()  # none of the moved sessions went back


def test_a_session_sent_on_to_a_replica_that_died_before_taking_it_is_taken_from_the_first():
    """The failover soak's 409 (2026-12-04): the session held by replica B; B dies, its request
    goes to A, which dies before taking it; A is back first. The lease is still B's, and A must be
    told B is dead, though the table now names A (the session's first choice)."""
    routes = Routes(["replica-0", "replica-1"])
    session = next(f"s{i}" for i in range(100) if rank(f"s{i}", routes.replicas)[0] == "replica-0")
    routes.fail("replica-0")
    assert routes.pick(session) == "replica-1"  # held by replica-1 from here (its lease in the store)
    routes.revive("replica-0")
    assert routes.pick(session) == "replica-1" and routes.seen_dead("replica-1") == []
    routes.fail("replica-1")  # dies holding it
    assert routes.pick(session) == "replica-0"
    routes.fail("replica-0")  # dies before it took the session
    with pytest.raises(NoReplica):
        routes.pick(session)
    routes.revive("replica-0")  # back first
    assert routes.pick(session) == "replica-0"
    assert routes.seen_dead("replica-0") == ["replica-1"]  # the lease's holder, which replica-0 takes over


def test_a_request_tries_each_replica_once_then_none_is_left():
    routes = Routes(list(REPLICAS))
    first = routes.pick("s")
    second = routes.pick("s", {first})
    third = routes.pick("s", {first, second})
    assert len({first, second, third}) == 3
    with pytest.raises(NoReplica, match="every replica up failed"):
        routes.pick("s", {first, second, third})
    for name in REPLICAS:
        routes.fail(name)
    with pytest.raises(NoReplica, match="no replica is up"):
        routes.pick("s")


def test_settle_records_the_replica_that_answered():
    routes = Routes(list(REPLICAS))
    home = routes.pick("s")
    other = next(r for r in REPLICAS if r != home)
    routes.settle("s", other)  # found holding it (a front restarted while the session was elsewhere)
    assert routes.pick("s") == other
    routes.settle("s", home)
    assert routes.owner == {} and routes.pick("s") == home


def test_throwaway_requests_take_turns_over_the_replicas_up():
    routes = Routes(list(REPLICAS))
    assert set(routes.pick(None) for _ in range(6)) == set(REPLICAS)
    routes.fail("replica-0")
    assert set(routes.pick(None) for _ in range(6)) == {"replica-1", "replica-2"}
