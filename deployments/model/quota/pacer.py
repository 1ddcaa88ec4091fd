"""A replica's side of the shared quota: every upstream call claims its request and tokens before it is sent.

``QuotaPacer.paced`` wraps one batch's upstream call (its inputs are ``PacedInput``: a batch never mixes
priorities, so the first input's is the batch's). The claim goes to the ``QuotaLimiter`` actor, with what the
provider's last responses said; a HIGH claim also asks for a small lease, so the next few HIGH calls are granted here
without a round trip. If the actor cannot be reached, the replica paces alone on an equal share of the limits
(limits / replicas) for a while, says so in a metric and a log line, and then tries the actor again: a request never
fails because the limiter is down.

A claim the budget cannot grant before the batch's latest deadline is not sent: its inputs end in a 429 whose
Retry-After is when the budget will hold them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import time
from typing import Any, Awaitable, Callable, Hashable, Mapping, Protocol, Sequence

from batching import Priority

from deployments.errors import UpstreamRateLimited
from deployments.model.backends.base import UpstreamError
from deployments.model.quota.budget import Account, Claim, Limits, QuotaBudget
from deployments.model.quota.headers import provider_accounts
from deployments.model.quota.limiter import Answer, Report, connect
from deployments.model.quota.metrics import QuotaMetrics
from deployments.wire import Deadline

logger = logging.getLogger("ray.serve")

CALL_TIMEOUT_S = 1.0  # an actor that takes longer to answer a claim counts as unreachable
ALONE_S = 5.0  # after the actor failed, pace alone this long before asking it again
MIN_POLL_S = 0.01  # a LOW claim asks again no sooner than this
LEASE_CALLS = 4  # a HIGH lease holds about this many calls
LEASE_TTL_S = 5.0  # a lease not spent by then is dropped (it was counted as spent when granted)
MAX_REPORTS = 8  # provider reports kept for the next claim (the latest matter)
CALL_ROOM = 2.0  # a wait leaves this many times an upstream call's recent mean duration before the cap or deadline
_CALL_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("quota_call_started")


class PacedInput:
    """A prepared input queued for a paced model: ``content`` and ``tokens`` as ``Prepared``, with the priority and
    deadline its batch is claimed with. Equal by content, so equal inputs of a batch are still sent once."""

    __slots__ = ("content", "tokens", "priority", "deadline")

    def __init__(self, content: Hashable, tokens: int, priority: Priority, deadline: Deadline | None) -> None:
        self.content = content
        self.tokens = tokens
        self.priority = priority
        self.deadline = deadline

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PacedInput) and other.content == self.content

    def __hash__(self) -> int:
        return hash(self.content)


class SharedLedger(Protocol):
    """Where the one budget is (the ``QuotaLimiter`` actor); any failure means it cannot be reached."""

    async def claim(self, priority: Priority, tokens: int, max_wait_s: float | None, lease: tuple[int, int],
                    reports: list[Report]) -> Answer: ...

    async def report(self, reports: list[Report]) -> None: ...

    async def release(self, tokens: int) -> None: ...


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

    async def report(self, reports: list[Report]) -> None:
        actor = await self._connected()
        actor.report.remote(reports)

    async def release(self, tokens: int) -> None:
        actor = await self._connected()
        actor.release.remote(tokens)

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
        self._lease = [0, 0]
        self._lease_until = -math.inf
        self._high_tokens = 0.0  # mean tokens of a HIGH call, for the lease's size

    async def paced(self, inputs: Sequence[PacedInput],
                    send: Callable[[], Awaitable[Sequence[Any]]]) -> Sequence[Any]:
        """``send()``'s results once the budget holds this call. If it will not within ``max_wait_s`` or before the
        batch's latest deadline, each input whose deadline comes first ends in a 429 saying when the budget will
        hold it, and the others fail retryably: the batcher queues them again for that moment (with what queued
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
        """Each input's 429 if the budget holds the call only after its deadline, else a retryable failure that
        queues it again for when the budget will hold it."""
        sent_by = asyncio.get_running_loop().time() + wait_s + self._call_room_s
        late = UpstreamRateLimited(
            f"the upstream's quota will not hold this request within its deadline; retry in {wait_s:.1f}s",
            retry_after_s=wait_s)
        later = UpstreamError(f"the upstream's quota holds this call in {wait_s:.3f}s", status=429, retryable=True,
                              retry_after_s=wait_s)
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
            asyncio.get_running_loop().create_task(self._report_now())

    # ---- claiming -------------------------------------------------------------------------------------------

    async def _acquire(self, priority: Priority, tokens: int, max_wait_s: float | None) -> None:
        started = self._clock()
        if priority is Priority.HIGH:
            self._high_tokens += (tokens - self._high_tokens) / 8 if self._high_tokens else tokens
            if self._from_lease(tokens, started):
                self._granted(priority, tokens, started)
                return
        deadline = None if max_wait_s is None else started + max_wait_s
        while True:
            left = None if deadline is None else deadline - self._clock()
            claim, shared = await self._claim(priority, tokens, left)
            if claim.granted:
                if claim.wait_s > 0:
                    try:
                        await asyncio.sleep(claim.wait_s)
                    except asyncio.CancelledError:  # never sent: what it reserved goes back
                        self._release(tokens, shared)
                        raise
                self._granted(priority, tokens, started)
                return
            left = None if deadline is None else deadline - self._clock()
            if left is not None and claim.wait_s > left:
                raise _NotInTime(claim.wait_s)
            await asyncio.sleep(max(MIN_POLL_S, claim.wait_s))

    def _granted(self, priority: Priority, tokens: int, started: float) -> None:
        self._metrics.used(priority, 1, tokens)
        self._metrics.waited(priority, self._clock() - started)

    def _from_lease(self, tokens: int, now: float) -> bool:
        lease = self._lease
        if now >= self._lease_until or lease[0] < 1 or lease[1] < tokens:
            return False
        lease[0] -= 1
        lease[1] -= tokens
        return True

    async def _claim(self, priority: Priority, tokens: int, max_wait_s: float | None) -> tuple[Claim, bool]:
        """The claim's answer, and whether the shared budget gave it."""
        now = self._clock()
        if not self._limited and not self._reports:
            return Claim(True, 0.0), False  # no limit known anywhere: nothing to pace
        wants = (LEASE_CALLS, int(LEASE_CALLS * self._high_tokens)) if priority is Priority.HIGH else (0, 0)
        if self._alone_until is None or now >= self._alone_until:
            reports = self._take_reports(now)
            try:
                result = await asyncio.wait_for(self._shared.claim(priority, tokens, max_wait_s, wants, reports),
                                                CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - whatever it is, the replica paces alone
                self._go_alone(exc)
            else:
                self._back(result)
                return result.claim, True
        return self._alone.claim(priority, tokens, self._clock(), max_wait_s=max_wait_s), False

    def _release(self, tokens: int, shared: bool) -> None:
        if not shared:
            self._alone.release(tokens, self._clock())
            return

        async def release() -> None:
            try:
                await asyncio.wait_for(self._shared.release(tokens), CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a reservation lost costs a moment of the budget, nothing more
                pass

        asyncio.get_running_loop().create_task(release())

    def _back(self, result: Answer) -> None:
        if self._alone_until is not None:
            logger.warning("quota: the shared budget answers again; this replica stops pacing alone")
            self._metrics.fallback(False)
            self._alone_until = None
        self._limited = result.limited
        for priority_name, amounts in result.remaining.items():
            for kind, amount in amounts.items():
                self._metrics.remaining(Priority[priority_name.upper()], kind, amount)
        if result.claim.leased[0]:
            self._lease = list(result.claim.leased)
            self._lease_until = self._clock() + LEASE_TTL_S

    def _go_alone(self, exc: BaseException) -> None:
        first = self._alone_until is None
        self._alone_until = self._clock() + ALONE_S
        if first:
            logger.warning("quota: the shared budget cannot be reached (%s: %s); this replica paces alone on 1/%d of "
                           "the limits", type(exc).__name__, exc, self._replicas)
            self._metrics.fallback(True)

    def _take_reports(self, now: float) -> list[Report]:
        reports = [report._replace(age_s=now - called_at)
                   for report, called_at in zip(self._reports, self._report_times)]
        self._reports, self._report_times = [], []
        return reports

    async def _report_now(self) -> None:
        if self._alone_until is not None:
            return
        try:
            await asyncio.wait_for(self._shared.report(self._take_reports(self._clock())), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._go_alone(exc)


def _share(account: Account, replicas: int) -> Account:
    def part(count: int | None) -> int | None:
        return None if count is None else count // replicas

    return Account(part(account.limit), part(account.remaining), account.reset_s)


class _NotInTime(Exception):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"the budget holds the call in {wait_s:.3f}s")
        self.wait_s = wait_s
