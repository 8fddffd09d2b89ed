"""Which replica serves a request: session affinity, and where a session goes when its replica dies.

Pure Python (no Ray, no HTTP), so the rules can be read and tested on their own; the front
(front.py) asks `Routes` for a replica before each attempt and tells it what happened.

- A session's first request picks its replica by rendezvous hashing over the replicas that are
  up (the highest hash of session and replica name wins): with every replica up, a session
  always lands on the same one, from whichever front, without shared state.
- From then on it stays there (`owner`): while that replica is up, every request of the session
  goes to it, so its brain stays in that replica's memory and no two replicas hold it.
- A replica that fails (refused a connection, or broke one) is marked down; its sessions move on
  their next request to the next replica in their own hash order that is up, and stay there.
  The store holds their last checkpoint, so they resume exactly (the server's own resume).
- A replica that comes back (Ray restarted it) takes new sessions again; sessions that moved
  away stay where they are (their new replica holds them in memory).
- A request without a session goes to the next replica that is up, in turn.
- A session's request tells its replica every replica the front sees down (`seen_dead`): the
  session's lease may be any of theirs, not only the one the table names (a session sent on to
  a replica that died before it took the session is still held by the one before).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)")


class NoReplica(Exception):
    """Every replica is down (or was tried for this request)."""


def session_of(path: str, headers: dict[str, str], body: bytes) -> str | None:
    """The session a request belongs to, as the server reads it: the `X-Session-Id` header, else
    the JSON body's `user` field; for GET /v1/sessions/ID, ID. None: a throwaway request. A value
    the server would refuse is returned as it is: the replica answers the 400."""
    if match := SESSION_PATH.fullmatch(path):
        return match.group(1)
    if sid := headers.get("x-session-id"):
        return sid
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        user = json.loads(body).get("user")
    except (ValueError, AttributeError, RecursionError):  # not JSON, or not an object: the replica says why
        return None
    return user if isinstance(user, str) and user else None


def rank(session: str, replicas: list[str]) -> list[str]:
    """`replicas` in the session's rendezvous order: the first is its home while all are up."""
    def weight(name: str) -> bytes:
        return hashlib.blake2b(f"{name}\0{session}".encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


@dataclass
class Routes:
    """The front's view of its replicas and where each session lives (see the module's text)."""

    replicas: list[str]
    owner: dict[str, str] = field(default_factory=dict)  # session -> its replica, where not its first choice
    down: set[str] = field(default_factory=set)  # replicas marked down, until they answer again
    moved: int = 0  # sessions sent away from their replica (or first choice) because it was down
    _turn: int = 0

    def up(self) -> list[str]:
        return [name for name in self.replicas if name not in self.down]

    def pick(self, session: str | None, tried: set[str] = frozenset()) -> str:
        """The replica for a request of `session` (None: throwaway), skipping those `tried` for
        this request already; NoReplica if none is left."""
        live = [name for name in self.up() if name not in tried]
        if not live:
            raise NoReplica(f"no replica is up (of {len(self.replicas)})" if not self.up() else
                            f"every replica up failed this request ({', '.join(sorted(tried))})")
        if session is None:
            self._turn += 1
            return live[self._turn % len(live)]
        held = self.owner.get(session)
        if held in live:
            return held
        order = rank(session, self.replicas)
        home = next(name for name in order if name in live)
        self.moved += (held or order[0]) != home
        # only sessions away from their first choice are written down: the table holds the
        # sessions that failures moved, not every session ever seen
        if home == order[0]:
            self.owner.pop(session, None)
        else:
            self.owner[session] = home
        return home

    def settle(self, session: str, replica: str) -> None:
        """`replica` answered for `session` (the one that holds it, found by trying): it stays there."""
        if rank(session, self.replicas)[0] == replica:
            self.owner.pop(session, None)
        else:
            self.owner[session] = replica

    def fail(self, replica: str) -> None:
        """`replica` broke a request: down until `revive`."""
        self.down.add(replica)

    def revive(self, replica: str) -> None:
        self.down.discard(replica)

    def seen_dead(self, replica: str) -> list[str]:
        """The replicas down but `replica`: a session's lease held by one of them is a dead
        process's, which `replica` may take over at once (cluster/store.py)."""
        return sorted(self.down - {replica})
