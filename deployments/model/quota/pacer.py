"""A replica's side of the shared quota: every upstream call claims its request and tokens before it is sent.

``QuotaPacer.paced`` wraps one batch's upstream call (its inputs are ``PacedInput``: a batch never mixes
priorities, so the first input's is the batch's). The claim goes to the ``QuotaLimiter`` actor, with what the
provider's last responses said, and asks for a lease: the calls of that priority this replica will make in the next
second or so, granted here from then on without a round trip. A lease is renewed in the background when half of it
is spent, so while the budget is far from its limits a call never waits for the actor and the actor hears from a
replica a few times a second whatever the request rate; near the limits the budget lends nothing and every call is
claimed on its own. A lease not spent within ``LEASE_TTL_S`` goes back. If the actor cannot be reached, the replica
paces alone on an equal share of the limits (limits / replicas) for a while, says so in a metric and a log line, and
then tries the actor again: a request never fails because the limiter is down.

A HIGH call waits for its reservation (HIGH reserves ahead); a LOW call the budget does not hold now is postponed:
it leaves its batch slot at once and the batcher queues it again for when the budget will hold it, so LOW waiting for
quota holds neither a slot nor the budget's queue ahead of HIGH. A claim the budget cannot grant before the batch's
latest deadline is not sent: its inputs end in a 429 whose Retry-After is when the budget will hold them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import time
from typing import Any, Awaitable, Callable, Hashable, Mapping, Protocol, Sequence

from batching import Postponed, Priority

from deployments.errors import UpstreamRateLimited
from deployments.model.quota.budget import Account, Claim, Limits, QuotaBudget
from deployments.model.quota.headers import provider_accounts
from deployments.model.quota.limiter import Answer, Report, connect
from deployments.model.quota.metrics import QuotaMetrics
from deployments.wire import Deadline

logger = logging.getLogger("ray.serve")

CALL_TIMEOUT_S = 1.0  # an actor that takes longer to answer a claim counts as unreachable
ALONE_S = 5.0  # after the actor failed, pace alone this long before asking it again
MIN_POLL_S = 0.01  # a postponed call asks again no sooner than this
LEASE_CALLS = 4  # a lease asks for at least this many calls
LEASE_S = 1.0  # ... and for the calls of this long at their recent rate
MIN_GAP_S = 0.001  # calls closer than this are counted this far apart (a lease's size stays finite)
LEASE_TTL_S = 5.0  # a lease not spent by then goes back to the shared budget
MAX_REPORTS = 8  # provider reports kept for the next claim (the latest matter)
CALL_ROOM = 2.0  # a wait leaves this many times an upstream call's recent mean duration before the cap or deadline
_CALL_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("quota_call_started")


class PacedInput:
    """A prepared input queued for a paced model: ``content`` and ``tokens`` as ``Prepared``, with the priority and
    deadline its batch is claimed with, and the tenant it is billed to (None: nobody in particular). Equal by
    content, so equal inputs of a batch are still sent once (and billed to the first one's tenant)."""

    __slots__ = ("content", "tokens", "priority", "deadline", "tenant")

    def __init__(self, content: Hashable, tokens: int, priority: Priority, deadline: Deadline | None,
                 tenant: str | None = None) -> None:
        self.content = content
        self.tokens = tokens
        self.priority = priority
        self.deadline = deadline
        self.tenant = tenant

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PacedInput) and other.content == self.content

    def __hash__(self) -> int:
        return hash(self.content)


class SharedLedger(Protocol):
    """Where the one budget is (the ``QuotaLimiter`` actor); any failure means it cannot be reached."""

    async def claim(self, priority: Priority, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
                    reports: list[Report]) -> Answer: ...

    async def renew(self, priority: Priority, lease: tuple[int, int], reports: list[Report]) -> Answer: ...

    async def report(self, reports: list[Report]) -> None: ...

    async def release(self, requests: int, tokens: int) -> None: ...


class RemoteLedger:
    """The ``QuotaLimiter`` actor named ``name``: found or created from the start (in a thread: creating an actor
    takes a worker's start-up, longer than a claim may wait), and again once it is known to have died.

    The handle is kept until then, whatever else fails: the actor lives while some replica holds a handle to it, so a
    replica that dropped its handle on a slow answer could end the budget for every replica."""

    def __init__(self, name: str, limits: Limits) -> None:
        self._name = name
        self._limits = limits
        self._actor: Any = None
        self._connecting: concurrent.futures.Future | None = None
        self._connect()

    async def claim(self, priority: Priority, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
                    reports: list[Report]) -> Answer:
        actor = await self._connected()
        try:
            return await actor.claim.remote(int(priority), tokens, max_wait_s, lease, reports)
        except Exception as exc:
            self._forget_if_dead(exc)
            raise

    async def renew(self, priority: Priority, lease: tuple[int, int], reports: list[Report]) -> Answer:
        actor = await self._connected()
        try:
            return await actor.renew.remote(int(priority), lease, reports)
        except Exception as exc:
            self._forget_if_dead(exc)
            raise

    async def report(self, reports: list[Report]) -> None:
        actor = await self._connected()
        actor.report.remote(reports)

    async def release(self, requests: int, tokens: int) -> None:
        actor = await self._connected()
        actor.release.remote(requests, tokens)

    def _connect(self) -> None:
        import ray

        if ray.is_initialized() and self._connecting is None:
            self._connecting = _CONNECTING.submit(connect, self._name, self._limits)

    async def _connected(self) -> Any:
        if self._actor is not None:
            return self._actor
        self._connect()
        if self._connecting is None:
            raise RuntimeError("not running under Ray")
        connecting = self._connecting
        try:  # shielded: a claim that stops waiting leaves the handle to the next one
            self._actor = await asyncio.shield(asyncio.wrap_future(connecting))
        except asyncio.CancelledError:
            raise
        except Exception:
            self._connecting = None  # tried again next time
            raise
        return self._actor

    def _forget_if_dead(self, exc: Exception) -> None:
        from ray.exceptions import ActorDiedError

        if isinstance(exc, ActorDiedError):
            self._actor = self._connecting = None  # the next claim finds its successor, or creates it


_CONNECTING = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="quota-connect")


class _Lease:
    """What the shared budget lent this replica for one priority's calls, and how those calls come (which sizes the
    next lease)."""

    __slots__ = ("requests", "tokens", "until", "renewing", "gap_s", "call_tokens", "last_call")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.until = -math.inf
        self.renewing = False
        self.gap_s = math.inf  # the recent mean time between calls
        self.call_tokens = 0.0  # the recent mean tokens of a call
        self.last_call: float | None = None

    def called(self, tokens: int, now: float) -> None:
        self.call_tokens += (tokens - self.call_tokens) / 8 if self.call_tokens else tokens
        if self.last_call is not None:
            gap = max(MIN_GAP_S, now - self.last_call)
            self.gap_s = gap if math.isinf(self.gap_s) else self.gap_s + (gap - self.gap_s) / 8
        self.last_call = now

    def wanted(self) -> tuple[int, int]:
        """The calls of the next ``LEASE_S`` at the recent rate (at least ``LEASE_CALLS``), and their tokens."""
        calls = max(LEASE_CALLS, math.ceil(LEASE_S / self.gap_s))
        return calls, math.ceil(calls * self.call_tokens)

    def short(self) -> bool:
        """Less than half a lease's worth of calls or of tokens left: time to ask for more, before it runs out."""
        calls, tokens = self.wanted()
        return self.requests * 2 < calls or self.tokens * 2 < tokens

    def spend(self, tokens: int, now: float) -> bool:
        if now >= self.until or self.requests < 1 or self.tokens < tokens:
            return False
        self.requests -= 1
        self.tokens -= tokens
        return True

    def add(self, leased: tuple[int, int], until: float) -> None:
        self.requests += leased[0]
        self.tokens += leased[1]
        self.until = until

    def take_all(self) -> tuple[int, int]:
        held = self.requests, self.tokens
        self.requests = self.tokens = 0
        return held


class QuotaPacer:
    def __init__(self, limits: Limits, shared: SharedLedger, *, replicas: int, metrics: QuotaMetrics | None = None,
                 max_wait_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``max_wait_s``: the longest a call may wait for the budget whatever its deadline (a batcher's
        ``batch_timeout_s`` counts the wait: a longer one would time the batch out)."""
        self._shared = shared
        self._max_wait_s = max_wait_s
        self._call_s = 0.0  # an upstream call's recent duration
        self._clock = clock
        self._metrics = metrics if metrics is not None else QuotaMetrics()
        self._replicas = replicas
        self._alone = QuotaBudget(limits.shared_by(replicas), clock())
        self._alone_until: float | None = None  # set while the shared budget is unreachable
        self._limited = limits.rpm is not None or limits.tpm is not None
        self._reports: list[Report] = []
        self._report_times: list[float] = []
        self._leases = {priority: _Lease() for priority in Priority}
        self._tasks: set[asyncio.Task] = set()  # renewals, releases and reports sent in the background

    async def paced(self, inputs: Sequence[PacedInput],
                    send: Callable[[], Awaitable[Sequence[Any]]]) -> Sequence[Any]:
        """``send()``'s results once the budget holds this call: a HIGH call waits here for its reservation. A LOW
        call the budget does not hold now, or a HIGH one it will not hold within ``max_wait_s`` or before the batch's
        latest deadline, is not sent: each input whose deadline comes first ends in a 429 saying when the budget
        will hold it, and the others are postponed, queued again by the batcher for that moment (with what queued
        since, in a larger batch)."""
        first = inputs[0]
        tokens = sum(item.tokens for item in inputs)
        deadlines = [item.deadline for item in inputs]
        # granted only if it is sent in time for its answer to be: the call's own time is kept free
        deadline_wait_s = (None if None in deadlines
                           else max(deadlines).remaining() - self._call_room_s)
        capped_wait_s = None if self._max_wait_s is None else self._max_wait_s - self._call_room_s
        known = [limit for limit in (deadline_wait_s, capped_wait_s) if limit is not None]
        try:
            await self._acquire(first.priority, tokens, min(known) if known else None)
        except _NotInTime as exc:
            return self._not_now(inputs, exc.wait_s)
        started = self._clock()
        _CALL_STARTED.set(started)
        try:
            return await send()
        finally:
            took = self._clock() - started
            self._call_s += (took - self._call_s) / 8 if self._call_s else took

    @property
    def _call_room_s(self) -> float:
        """Time kept free for the call itself after its wait: its recent mean is exceeded by one call in two."""
        return CALL_ROOM * self._call_s

    def _not_now(self, inputs: Sequence[PacedInput], wait_s: float) -> list[Exception]:
        """Each input's 429 if the budget holds the call only after its deadline, else ``Postponed``: the batcher
        queues it again for when the budget will hold it, and its slot serves others meanwhile."""
        sent_by = asyncio.get_running_loop().time() + wait_s + self._call_room_s
        late = UpstreamRateLimited(
            f"the upstream's quota will not hold this request within its deadline; retry in {wait_s:.1f}s",
            retry_after_s=wait_s)
        later = Postponed(max(MIN_POLL_S, wait_s), "the upstream's quota holds this call later")
        outcomes: list[Exception] = [late if item.deadline is not None and item.deadline.at < sent_by else later
                                     for item in inputs]
        refused = sum(outcome is late for outcome in outcomes)
        if refused:
            self._metrics.refused(inputs[0].priority, refused)
        return outcomes

    def observe(self, headers: Mapping[str, str], refused_for_s: float | None) -> None:
        """A response of the upstream (inside ``send``): its rate-limit headers, and a 429's delay if it was one."""
        accounts = provider_accounts(headers)
        now = self._clock()
        called_at = _CALL_STARTED.get(now)
        if refused_for_s is not None:
            self._metrics.upstream_rate_limited()
            self._alone.refused(refused_for_s, now)
        if accounts or self._alone.limited:  # alone, a replica counts on an equal share of what the provider says
            self._alone.follow({kind: _share(account, self._replicas) for kind, account in accounts.items()},
                               called_at, now)
        if refused_for_s is None and not accounts and not self._limited:
            return  # nothing to learn
        self._reports.append(Report(accounts, 0.0, refused_for_s))
        self._report_times.append(called_at)
        del self._reports[:-MAX_REPORTS], self._report_times[:-MAX_REPORTS]
        if refused_for_s is not None:  # the others wait for the next claim; this one stops every replica now
            for lease in self._leases.values():
                lease.take_all()  # the provider says there is nothing left to lend
            self._background(self._report_now())

    # ---- claiming -------------------------------------------------------------------------------------------

    async def _acquire(self, priority: Priority, tokens: int, max_wait_s: float | None) -> None:
        started = self._clock()
        lease = self._leases[priority]
        lease.called(tokens, started)
        if lease.spend(tokens, started):
            self._granted(priority, tokens, started)
            self._renew_if_short(priority)
            return
        claim, shared = await self._claim(priority, tokens, max_wait_s)
        if not claim.granted:  # LOW not held now, HIGH not in time: the batch leaves its slot
            raise _NotInTime(claim.wait_s)
        if claim.wait_s > 0:  # HIGH's reservation
            try:
                await asyncio.sleep(claim.wait_s)
            except asyncio.CancelledError:  # never sent: what it reserved goes back
                self._release(tokens, shared)
                raise
        self._granted(priority, tokens, started)

    def _granted(self, priority: Priority, tokens: int, started: float) -> None:
        self._metrics.used(priority, 1, tokens)
        self._metrics.waited(priority, self._clock() - started)

    async def _claim(self, priority: Priority, tokens: int, max_wait_s: float | None) -> tuple[Claim, bool]:
        """The claim's answer, and whether the shared budget gave it."""
        now = self._clock()
        if not self._limited and not self._reports:
            return Claim(True, 0.0), False  # no limit known anywhere: nothing to pace
        if self._alone_until is None or now >= self._alone_until:
            wants = self._leases[priority].wanted()
            reports = self._take_reports(now)
            try:
                result = await asyncio.wait_for(
                    self._shared.claim(priority, tokens, max_wait_s, wants, _aged(reports, now)), CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - whatever it is, the replica paces alone
                self._restore_reports(reports)
                self._go_alone(exc)
            else:
                self._back(result, priority)
                return result.claim, True
        return self._alone.claim(priority, tokens, self._clock(), max_wait_s=max_wait_s), False

    def _release(self, tokens: int, shared: bool, requests: int = 1) -> None:
        if not shared:
            self._alone.release(tokens, self._clock(), requests)
            return

        async def release() -> None:
            try:
                await asyncio.wait_for(self._shared.release(requests, tokens), CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - what is lost costs a moment of the budget, nothing more
                pass

        self._background(release())

    def _renew_if_short(self, priority: Priority) -> None:
        lease = self._leases[priority]
        if not lease.renewing and self._alone_until is None and lease.short():
            lease.renewing = True
            self._background(self._renew(priority))

    async def _renew(self, priority: Priority) -> None:
        lease = self._leases[priority]
        reports = self._take_reports(self._clock())
        try:
            result = await asyncio.wait_for(
                self._shared.renew(priority, lease.wanted(), _aged(reports, self._clock())), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the replica paces alone
            self._restore_reports(reports)
            self._go_alone(exc)
        else:
            self._back(result, priority)
        finally:
            lease.renewing = False

    def _expire(self, priority: Priority) -> None:
        """A lease not renewed within ``LEASE_TTL_S`` of its last grant: what is left of it goes back."""
        lease = self._leases[priority]
        if self._clock() >= lease.until:
            requests, tokens = lease.take_all()
            if requests:
                self._release(tokens, True, requests)

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _back(self, result: Answer, priority: Priority) -> None:
        if self._alone_until is not None:
            logger.warning("quota: the shared budget answers again; this replica stops pacing alone")
            self._metrics.fallback(False)
            self._alone_until = None
        self._limited = result.limited
        for priority_name, amounts in result.remaining.items():
            for kind, amount in amounts.items():
                self._metrics.remaining(Priority[priority_name.upper()], kind, amount)
        if result.claim.leased[0]:
            self._leases[priority].add(result.claim.leased, self._clock() + LEASE_TTL_S)
            asyncio.get_running_loop().call_later(LEASE_TTL_S, self._expire, priority)

    def _go_alone(self, exc: BaseException) -> None:
        first = self._alone_until is None
        self._alone_until = self._clock() + ALONE_S
        if first:
            logger.warning("quota: the shared budget cannot be reached (%s: %s); this replica paces alone on 1/%d of "
                           "the limits", type(exc).__name__, exc, self._replicas)
            self._metrics.fallback(True)

    def _take_reports(self, now: float) -> list[tuple[Report, float]]:
        taken = list(zip(self._reports, self._report_times))
        self._reports, self._report_times = [], []
        return taken

    def _restore_reports(self, taken: list[tuple[Report, float]]) -> None:
        """Reports a call failed to deliver go with the next one (before any that came since)."""
        self._reports[:0] = [report for report, _ in taken]
        self._report_times[:0] = [called_at for _, called_at in taken]
        del self._reports[:-MAX_REPORTS], self._report_times[:-MAX_REPORTS]

    async def _report_now(self) -> None:
        if self._alone_until is not None:
            return
        reports = self._take_reports(self._clock())
        try:
            await asyncio.wait_for(self._shared.report(_aged(reports, self._clock())), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._restore_reports(reports)
            self._go_alone(exc)


def _aged(taken: list[tuple[Report, float]], now: float) -> list[Report]:
    """The reports as sent: each with the age of the call it answered."""
    return [report._replace(age_s=now - called_at) for report, called_at in taken]


def _share(account: Account, replicas: int) -> Account:
    def part(count: int | None) -> int | None:
        return None if count is None else count // replicas

    return Account(part(account.limit), part(account.remaining), account.reset_s)


class _NotInTime(Exception):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"the budget holds the call in {wait_s:.3f}s")
        self.wait_s = wait_s
