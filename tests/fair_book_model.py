"""A model-based test of the fair book (``state.fair_book``): hypothesis drives producers that
assign tenants, publish, land and answer in any order (concurrent producers), workers that
read the book's landings, then the broker, then write, each step apart (stale reads, two
workers overlapping), and tasks taken from the lanes' heads, against a model of the broker's
lanes (FIFO queues).

Run against the memory book (``tests/unit/test_fair_book_model.py``) and the Redis one
(``tests/integration/test_fair_book_redis_model.py``): the same rules in both.

After every step:
- no lane looks emptier than it is: the book's load of each lane is at least its tasks on the
  broker plus its batches on their way (a worker's count read before a producer's batch
  landed must not wipe it: the defect that placed a new tenant on the "empty" lane holding
  2,000 tasks);
- a tenant with tasks waiting (on the broker or on their way) is placed on the lane holding
  them (its tasks stay in order), checked at each assignment;
- once every answer is written and a worker counts with nothing moving, the loads are the
  broker's exactly, a new tenant goes to an emptiest lane (Q on a tie), and so does a tenant
  whose tasks have all started, however many tasks of others its old lane holds (once every
  task that may have landed ahead of its last one has started too: landings of concurrent
  producers reach the book in no known order, so those count as ahead of it).
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weclaw_mq.state.fair_book import TENANT_KEEP_MS, FairBook, Landing

LANES = 3
TENANTS = ["a", "b", "c", "d"]
_T = TypeVar("_T")


@dataclass
class Batch:
    """Tasks of one tenant published to one lane: on its way, then answered, then told."""

    tenant: str
    lane: int
    tasks: int
    batch: str  # the book's flying batch; '' for a lane the producer knew
    landed: bool = False


class FairBookModel(RuleBasedStateMachine):
    """The book against the model broker; subclasses give the book and how to run a call."""

    # Producers that reuse a tenant's lane without asking (``publishing.fair_lanes``): their
    # tasks count once their landing is written, so the rules that need every task on the
    # book (a tenant kept on its lane) are not checked with them.
    KNOWN_LANES = False

    def __init__(self) -> None:
        super().__init__()
        self.queue = f"t-fair-book-model-{uuid.uuid4().hex[:8]}"
        self.book = self.make_book()
        self.queues: list[deque[Batch]] = [deque() for _ in range(LANES)]
        self.flying: list[Batch] = []  # published, no broker answer yet
        self.answered: list[Batch] = []  # answered, not yet told to the book
        self.known: dict[str, int] = {}  # tenant -> the lane a producer was given
        self.workers: list[tuple[list[int], list[int] | None] | None] = [None, None]
        self.newcomers = itertools.count()
        self.told: list[list[Batch]] = [[] for _ in range(LANES)]  # landings told, per lane
        # tenant -> the batches the book may count ahead of its last task on its lane
        self.ahead: dict[str, list[Batch]] = {}

    # -- what a subclass gives ---------------------------------------------------------------
    def make_book(self) -> FairBook:
        raise NotImplementedError

    def run(self, call: Awaitable[_T]) -> _T:
        raise NotImplementedError

    # -- the truth -------------------------------------------------------------------------
    def truth(self) -> list[int]:
        """Tasks each lane holds that the book can know of: on the broker (but a known
        lane's not yet told), or on their way from an assignment."""
        held = [0] * LANES
        for lane, queue in enumerate(self.queues):
            untold = {id(b) for b in self.answered if not b.batch}
            held[lane] = sum(1 for b in queue if id(b) not in untold)
        for b in self.flying:
            if b.batch:
                held[b.lane] += b.tasks
        return held

    def waiting_lanes(self, tenant: str) -> set[int]:
        lanes = {b.lane for b in self.flying if b.tenant == tenant}
        lanes |= {lane for lane, q in enumerate(self.queues) if any(b.tenant == tenant for b in q)}
        return lanes

    # -- producers -------------------------------------------------------------------------
    @rule(
        published=st.lists(
            st.tuples(st.sampled_from(TENANTS), st.integers(1, 4)),
            min_size=1,
            max_size=2,
            unique_by=lambda p: p[0],
        )
    )
    def publish(self, published: list[tuple[str, int]]) -> None:
        """A producer asks the book for its tenants' lanes (one script for the batch)."""
        tenants = [t for t, n in published for _ in range(n)]
        before = {t: self.waiting_lanes(t) for t, _ in published}
        placed = self.run(self.book.assign(self.queue, LANES, tenants, TENANT_KEEP_MS))
        lane_of = dict(zip(tenants, placed, strict=True))
        for tenant, n in published:
            lane, batch = lane_of[tenant]
            if not self.KNOWN_LANES:
                # Its tasks stay in order: a tenant with tasks waiting keeps their lane.
                assert before[tenant] <= {lane}, (tenant, before[tenant], lane)
            if self.known.get(tenant) != lane:
                self.ahead[tenant] = []  # a new lane: its place there starts afresh
            self.known[tenant] = lane
            self.flying.append(Batch(tenant, lane, n, batch))

    @precondition(lambda self: self.KNOWN_LANES and self.known)
    @rule(data=st.data(), tasks=st.integers(1, 4))
    def publish_to_a_known_lane(self, data: st.DataObject, tasks: int) -> None:
        tenant = data.draw(st.sampled_from(sorted(self.known)))
        self.flying.append(Batch(tenant, self.known[tenant], tasks, ""))

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), lands=st.booleans())
    def broker_answers(self, data: st.DataObject, lands: bool) -> None:
        """A batch lands on its lane (confirmed), or is refused, in any order."""
        b = self.flying.pop(data.draw(st.integers(0, len(self.flying) - 1)))
        b.landed = lands
        if lands:
            self.queues[b.lane].extend([b] * b.tasks)
        self.answered.append(b)

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def producer_tells_the_book(self, data: st.DataObject) -> None:
        """Some answers, in any order, in one write (a producer's flush)."""
        chosen = data.draw(
            st.lists(st.integers(0, len(self.answered) - 1), min_size=1, unique=True)
        )
        self.tell([self.answered[i] for i in chosen])

    def tell(self, told: list[Batch]) -> None:
        """Write ``told`` answers to the book (one producer's flush)."""
        for b in told:
            if b.landed:
                self.told[b.lane].append(b)
        on_way = [b for b in (*self.flying, *self.answered) if b.batch]
        for b in told:
            if b.landed and self.known.get(b.tenant) == b.lane:
                # Every landing told there so far, and every batch still on its way.
                lane = [x for x in (*self.told[b.lane], *on_way) if x.lane == b.lane]
                self.ahead.setdefault(b.tenant, []).extend(lane)
        self.answered = [b for b in self.answered if all(b is not t for t in told)]
        landings = [Landing(b.tenant, b.lane, b.tasks if b.landed else 0, b.batch) for b in told]
        self.run(self.book.settled(self.queue, LANES, landings, TENANT_KEEP_MS))

    def released(self, tenant: str) -> bool:
        """Whether the book must let ``tenant`` go: none of its tasks waits, and every task
        that may be ahead of its last one landed and started."""
        if self.waiting_lanes(tenant) or any(b.tenant == tenant for b in self.answered):
            return False
        ahead = {id(b) for b in self.ahead.get(tenant, [])}
        if any(not b.landed for b in self.ahead.get(tenant, [])):
            return False  # a refused batch counted ahead: it never lands, never starts
        return not any(id(b) in ahead for q in self.queues for b in q)

    # -- the broker's consumers ------------------------------------------------------------
    @rule(lane=st.integers(0, LANES - 1), tasks=st.integers(1, 3))
    def a_worker_takes_tasks(self, lane: int, tasks: int) -> None:
        queue = self.queues[lane]
        for _ in range(min(tasks, len(queue))):
            queue.popleft()

    # -- the workers' counts, each step apart ------------------------------------------------
    @rule(worker=st.integers(0, 1))
    def worker_reads_the_landings(self, worker: int) -> None:
        self.workers[worker] = (self.run(self.book.landed(self.queue, LANES)), None)

    @rule(worker=st.integers(0, 1))
    def worker_reads_the_broker(self, worker: int) -> None:
        state = self.workers[worker]
        if state is not None and state[1] is None:
            self.workers[worker] = (state[0], [len(q) for q in self.queues])

    @rule(worker=st.integers(0, 1))
    def worker_writes_its_count(self, worker: int) -> None:
        state = self.workers[worker]
        if state is not None and state[1] is not None:
            self.run(self.book.counted(self.queue, state[1], state[0], TENANT_KEEP_MS))
            self.workers[worker] = None

    # -- settled -----------------------------------------------------------------------------
    @rule(data=st.data())
    def everything_told_then_a_quiet_count(self, data: st.DataObject) -> None:
        """Every answer written, then one worker's count with nothing moving: the book holds
        the broker's truth, and a new tenant, or one whose tasks all started, takes an
        emptiest lane."""
        self.tell(list(self.answered))
        covered = self.run(self.book.landed(self.queue, LANES))
        ready = [len(q) for q in self.queues]
        self.run(self.book.counted(self.queue, ready, covered, TENANT_KEEP_MS))
        truth = self.truth()
        assert self.run(self.book.loads(self.queue, LANES)) == truth
        free = [t for t in TENANTS if t in self.known and self.released(t)]
        tenant = f"new-{next(self.newcomers)}"
        if free and not self.KNOWN_LANES:
            tenant = data.draw(st.sampled_from([*free, tenant]))
        ((lane, batch),) = self.run(self.book.assign(self.queue, LANES, [tenant], TENANT_KEEP_MS))
        emptiest = min(range(LANES), key=lambda j: (truth[j], j))
        assert lane == emptiest, (tenant, lane, truth)
        if self.known.get(tenant) != lane:
            self.ahead[tenant] = []
        self.known[tenant] = lane
        self.flying.append(Batch(tenant, lane, 1, batch))

    @invariant()
    def no_lane_looks_emptier_than_it_is(self) -> None:
        loads = self.run(self.book.loads(self.queue, LANES))
        truth = self.truth()
        assert all(n >= t for n, t in zip(loads, truth, strict=True)), (loads, truth)
