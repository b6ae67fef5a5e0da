"""Which advisories reach the engine: a session's repeats are answered without it.

An advisory costs the server a read of the session's messages, a render of its conversation
into tokens, and the engine a hash of every chunk of them; it is worth that only when it
brings forward something the last one did not. Two rules, per session:

- typing: a `typing` frame within `typing_interval_s` of the last one counts once (a client
  that sends one per keystroke);
- any source: an advisory while the session's conversation is unchanged since the last one
  that reached the engine, within `repeat_interval_s` of it, is a repeat and gets that one's
  answer, unless it expects the turn much sooner than that one did (in under half the time
  that one had left: it moves the prefetch ahead of others), a turn of the session began since
  (the turn used that one up in the engine, even one that changed nothing yet), it has a
  higher priority (it moves the prefetch ahead of others' of lower priority), or the engine
  has let that one go (`--advisory-ttl-s` past its expected arrival). An agent that advises again
  after each call changes the conversation (the call's exchange is kept first), so each of
  its advisories goes through. A repeat that expects the turn later than the last leaves the
  last's expiry as it was.

Each rule bounds what a client looping on one session costs: typing, one advisory an
interval; the rest, per interval, one plus a halving series of sooner arrivals (about 20) and
one per priority step up.

`ArrivalOrder` gives an `ordered` advisory its place: its turn comes after those of the
ordered advisories its API key sent before it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

MAX_SESSIONS = 10_000  # sessions remembered per rule before those gone quiet are pruned
V = TypeVar("V")


@dataclasses.dataclass(frozen=True)
class Advised:
    """What an advisory did: the context tokens the engine's KV tiers hold for the session
    (None: the engine keeps no tiers, or a typing repeat was dropped unanswered), and whether
    it repeated the session's last one (not sent to the engine)."""

    context_tokens_held: int | None
    repeat: bool = False


@dataclasses.dataclass(frozen=True)
class _Sent:
    revision: Hashable  # the session's conversation as it was (`SessionStore.revision`)
    at_s: float  # time.monotonic() when it was sent
    due_s: float  # time.monotonic() when it expected the turn
    held: int | None
    priority: int


class AdvisoryFilter:
    """The two rules above. Not thread-safe: the server's event loop calls it."""

    def __init__(self, typing_interval_s: float, repeat_interval_s: float,
                 advisory_ttl_s: float | None = None) -> None:
        """`advisory_ttl_s`: how long past its expected arrival the engine keeps an advisory
        (`--advisory-ttl-s`): one it has expired is repeated by none (None: no bound)."""
        self.typing_interval_s = typing_interval_s
        self.repeat_interval_s = repeat_interval_s
        self.advisory_ttl_s = math.inf if advisory_ttl_s is None else advisory_ttl_s
        self._last_typing_s: dict[str, float] = {}  # session id -> its last typing advisory
        self._last_sent: dict[str, _Sent] = {}  # session id -> its last advisory sent

    def is_typing_repeat(self, session_id: str) -> bool:
        """Whether a typing advisory for `session_id` now repeats one within the interval;
        records it as the last otherwise."""
        now = time.monotonic()
        last = self._last_typing_s.get(session_id)
        if last is not None and now - last < self.typing_interval_s:
            return True
        self._last_typing_s = _pruned(self._last_typing_s, lambda t: now - t,
                                      self.typing_interval_s)
        self._last_typing_s[session_id] = now
        return False

    def repeat_of(self, session_id: str, revision: Hashable, expected_arrival_s: float | None,
                  priority: int = 0) -> Advised | None:
        """The answer to give an advisory for `session_id`, whose conversation is now at
        `revision` and whose turn it expects in `expected_arrival_s` seconds (None: now) with
        `priority`, if it repeats the last one sent; None: send it."""
        last, now = self._last_sent.get(session_id), time.monotonic()
        if (last is None or last.revision != revision or priority > last.priority
                or now - last.at_s >= self.repeat_interval_s
                or now >= last.due_s + self.advisory_ttl_s  # the engine has let it go
                or (expected_arrival_s or 0.0) < (last.due_s - now) / 2):
            return None
        return Advised(last.held, repeat=True)

    def forget(self, session_id: str) -> None:
        """A turn of `session_id` began: it takes the session's advisory in the engine, so
        the next one repeats nothing."""
        self._last_sent.pop(session_id, None)

    def sent(self, session_id: str, revision: Hashable, expected_arrival_s: float | None,
             held: int | None, priority: int = 0) -> None:
        """Record that an advisory for `session_id` at `revision` reached the engine (read
        before the conversation was: a change meanwhile makes the next one go through)."""
        now = time.monotonic()
        self._last_sent = _pruned(self._last_sent, lambda s: now - s.at_s,
                                  self.repeat_interval_s)
        self._last_sent[session_id] = _Sent(revision, now, now + (expected_arrival_s or 0.0),
                                            held, priority)


class ArrivalOrder:
    """Symphony's `ordered` advisories: the turns of those one API key sends come in the
    order it sent them, so each is expected no sooner than those of the other sessions before
    it whose turns have not come yet (expected at the same time, it is fetched after them).
    A session's own later advisory takes its earlier one's place, which may be sooner. Not
    thread-safe: the server's event loop calls it."""

    def __init__(self) -> None:
        self._due_s: dict[str, dict[str, float]] = {}  # owner -> session id -> its turn's due
        self._owner: dict[str, str] = {}  # session id -> the owner it is pending under

    def expected_arrival(self, owner: str, session_id: str,
                         expected_arrival_s: float | None) -> float | None:
        """When the turn of `session_id`'s ordered advisory from `owner`, expecting it in
        `expected_arrival_s` seconds (None: now), is expected, in seconds from now (None:
        now)."""
        now = time.monotonic()
        asked = now + (expected_arrival_s or 0.0)
        if len(self._owner) >= MAX_SESSIONS:  # those whose turns are past due count no more
            for pending, pending_owner in list(self._owner.items()):
                if self._due_s[pending_owner][pending] <= now:
                    self.arrived(pending)
        before = {s: d for s, d in self._due_s.get(owner, {}).items()
                  if s != session_id and d > now}  # a turn due in the past delays none
        due = max(asked, *before.values()) if before else asked
        self.arrived(session_id)
        self._due_s.setdefault(owner, {})[session_id] = due
        self._owner[session_id] = owner
        return expected_arrival_s if due == asked else due - now

    def arrived(self, session_id: str) -> None:
        """A turn of `session_id` began: it holds back no later ordered advisory."""
        owner = self._owner.pop(session_id, None)
        if owner is not None:
            pending = self._due_s[owner]
            del pending[session_id]
            if not pending:
                del self._due_s[owner]


def _pruned(last: dict[str, V], age_s: Callable[[V], float], keep_s: float) -> dict[str, V]:
    """`last` (session id -> what it last did), without the sessions whose entry is
    `keep_s` old or older once it holds `MAX_SESSIONS`: they count for nothing any more."""
    if len(last) < MAX_SESSIONS:
        return last
    return {k: v for k, v in last.items() if age_s(v) < keep_s}
