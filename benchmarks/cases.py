"""The cases and contenders of a run, and how each measurement is set up.

Each measurement runs one contender in its own process (``infra.Children``); a case runs
every contender ``repeats`` times, in an order rotated by one each repeat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from weclaw_mq import App, Settings

from .common import ChildConfig, make_payload, now_ns
from .infra import Child, Children, ContenderFailed, Infra
from .report import Results, RowSpec, Target

SLEEP_S = 0.05  # the I/O-bound handler: asyncio.sleep(0.05) standing in for a model call
E2E_WARMUP = 5


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    module: str
    guard: bool = False  # weclaw: guard + results on; raw: the Redis calls by hand
    dramatiq: bool = False  # declares its own queues and needs its own message format
    short: str = ""  # how a ratio names it as the baseline
    # Dramatiq as its CLI runs it: this many worker processes of ``threads`` threads each
    # (0: one process, threads = the case's concurrency)
    processes: int = 0
    threads: int = 0
    loop: str = "asyncio"  # weclaw: the worker's event loop (weclaw_mq.worker.event_loop)


RAW = Contender("raw", "raw aio-pika", "raw_aiopika", short="raw")
RAW_REDIS = Contender(
    "raw-redis", "raw aio-pika + Redis by hand", "raw_aiopika", guard=True, short="raw+Redis"
)
WECLAW = Contender("weclaw", "weclaw_mq (guard off)", "weclaw")
WECLAW_GUARD = Contender(
    "weclaw-guard", "weclaw_mq (guard + results)", "weclaw", guard=True, short="1 process"
)
WECLAW_GUARD_UVLOOP = Contender(
    "weclaw-guard-uvloop",
    "weclaw_mq (guard + results, uvloop)",
    "weclaw",
    guard=True,
    loop="uvloop",
)
# The same contender as the uvloop row's baseline, named for what differs.
ASYNCIO_LOOP = dataclasses.replace(WECLAW_GUARD, short="asyncio loop")
# ``weclaw-mq worker --processes 2``: the supervisor and its two children (guard + results).
WECLAW_GUARD_PROCESSES = Contender(
    "weclaw-guard-p2",
    "weclaw_mq --processes 2 (guard + results)",
    "weclaw_processes",
    guard=True,
    processes=2,
)
FASTSTREAM = Contender("faststream", "FastStream", "faststream_bench")
DRAMATIQ = Contender(
    "dramatiq", "Dramatiq (1 process, threads = c)", "dramatiq_bench", dramatiq=True
)
# What Dramatiq's docs recommend: the ``dramatiq`` CLI's defaults, one process per CPU and 8
# threads each (its prefetch: twice the threads), whatever the case's concurrency.
DRAMATIQ_PROCESSES = os.cpu_count() or 1
DRAMATIQ_THREADS = 8
DRAMATIQ_CLI = Contender(
    "dramatiq-cli",
    f"Dramatiq ({DRAMATIQ_PROCESSES} processes x {DRAMATIQ_THREADS} threads, its CLI defaults)",
    "dramatiq_bench",
    dramatiq=True,
    processes=DRAMATIQ_PROCESSES,
    threads=DRAMATIQ_THREADS,
)

PUB_RAW = Contender("raw", "raw aio-pika (confirm, mandatory)", "raw_aiopika", short="raw")
PUB_WECLAW = Contender("weclaw", "weclaw_mq App.publish (results off)", "weclaw")
PUB_WECLAW_RESULTS = Contender(
    "weclaw-results", "weclaw_mq App.publish (results on)", "weclaw", guard=True
)
MANY_RAW = Contender("raw", "raw aio-pika gather, one channel", "raw_aiopika", short="raw")
MANY_WECLAW = Contender("weclaw", "weclaw_mq publish_many (results off)", "weclaw")
MANY_WECLAW_RESULTS = Contender(
    "weclaw-results", "weclaw_mq publish_many (results on)", "weclaw", guard=True
)


@dataclass
class Counts:
    consume: dict[int, int]  # concurrency -> messages
    io_concurrency: tuple[int, ...]
    io_waves: int  # messages = concurrency * waves: about waves * 50 ms per run
    # The "io-high" case (make bench-io-high, which make bench runs): thousands in flight.
    io_high_concurrency: tuple[int, ...]
    io_high_waves: int
    publish: int
    publish_many_batches: int  # of 100 messages
    rss: int
    e2e: int
    e2e_interval_s: float

    def scaled(self, factor: float) -> Counts:
        def s(n: int, floor: int) -> int:
            return max(floor, round(n * factor))

        return Counts(
            consume={c: s(n, 50) for c, n in self.consume.items()},
            io_concurrency=self.io_concurrency,
            io_waves=s(self.io_waves, 3),
            io_high_concurrency=self.io_high_concurrency,
            io_high_waves=s(self.io_high_waves, 2),
            publish=s(self.publish, 50),
            publish_many_batches=s(self.publish_many_batches, 2),
            rss=self.rss,
            e2e=s(self.e2e, 20),
            e2e_interval_s=self.e2e_interval_s,
        )


FULL = Counts(
    consume={1: 1500, 10: 6000, 100: 8000},
    io_concurrency=(8, 32, 128),
    io_waves=40,
    io_high_concurrency=(512, 2000),
    io_high_waves=5,
    publish=2000,
    publish_many_batches=50,
    rss=50,
    e2e=200,
    e2e_interval_s=0.01,
)
SMOKE = Counts(
    consume={10: 200},
    io_concurrency=(8,),
    io_waves=4,
    io_high_concurrency=(512,),
    io_high_waves=2,
    publish=100,
    publish_many_batches=3,
    rss=20,
    e2e=20,
    e2e_interval_s=0.005,
)
CASES = ("consume", "processes", "io", "publish", "rss", "e2e")
# Run only when asked for (--cases io-high): make bench runs them through their own target.
EXTRA_CASES = ("io-high",)
OURS_AND_BASELINES = frozenset(
    {
        "raw",
        "raw-redis",
        "weclaw",
        "weclaw-guard",
        "weclaw-guard-uvloop",
        "weclaw-guard-p2",
        "weclaw-results",
    }
)
PROCESSES_CONCURRENCY = 100  # per process, as in the guarded c=100 consume case


Runner = Callable[["Contender", int], Awaitable[dict[str, float]]]


@dataclass
class Bench:
    infra: Infra
    children: Children
    counts: Counts
    repeats: int
    cases: tuple[str, ...]
    skip_peers: bool
    only: frozenset[str] = frozenset()  # contender keys to run; empty: all
    results: Results = field(default_factory=Results)
    # case id -> (its contenders by key, one measurement): costs.explain_misses runs it again
    runners: dict[str, tuple[dict[str, Contender], Runner]] = field(default_factory=dict)

    # -- one run of one contender ---------------------------------------------------------
    def _cfg(self, mode: str, queue: str, contender: Contender, **kw: Any) -> ChildConfig:
        return ChildConfig(
            mode=mode,
            queue=queue,
            amqp_url=self.infra.amqp_url,
            redis_url=self.infra.redis_url,
            guard=contender.guard,
            **kw,
        )

    async def _consume(
        self,
        case: str,
        contender: Contender,
        repeat: int,
        *,
        count: int,
        concurrency: int,
        sleep_s: float = 0.0,
        idle_rss: bool = False,
    ) -> dict[str, Any]:
        queue = self.infra.new_queue(case, contender.key, f"r{repeat}")
        try:
            arguments = {} if contender.dramatiq else await self.infra.declare_weclaw(queue)
            timeout_s = 60 + count / 100 + count * sleep_s / concurrency * 3
            extra: dict[str, Any] = {"queue_arguments": arguments, "timeout_s": timeout_s}
            if contender.processes:
                extra.update(processes=contender.processes, threads=contender.threads)
            if contender.loop != "asyncio":
                extra["loop"] = contender.loop
            cfg = self._cfg(
                "consume",
                queue,
                contender,
                count=count,
                concurrency=concurrency,
                sleep_s=sleep_s,
                extra=extra,
            )

            async def fill() -> None:
                await self.infra.fill(queue, count, dramatiq=contender.dramatiq)

            return await self.children.run(
                contender.module,
                cfg,
                queue,
                before_go=fill,
                fill_while_starting=not contender.dramatiq,
                done_timeout_s=timeout_s,
                idle_rss_after_s=1.0 if idle_rss else None,
            )
        finally:
            await self.infra.delete(queue)

    async def _publish(
        self, case: str, mode: str, contender: Contender, repeat: int, *, count: int
    ) -> dict[str, Any]:
        queue = self.infra.new_queue(case, contender.key, f"r{repeat}")
        try:
            await self.infra.declare_weclaw(queue)
            cfg = self._cfg(
                mode, queue, contender, count=count, batch=100, extra={"task_prefix": queue}
            )
            return await self.children.run(
                contender.module, cfg, queue, done_timeout_s=60 + count / 50
            )
        finally:
            await self.infra.delete(queue)

    async def _e2e(self, case: str, contender: Contender, repeat: int) -> dict[str, Any]:
        queue = self.infra.new_queue(case, contender.key, f"r{repeat}")
        n = self.counts.e2e
        interval = self.counts.e2e_interval_s
        publisher: App | None = None
        try:
            await self.infra.declare_weclaw(queue)
            cfg = self._cfg("e2e", queue, contender, count=n + E2E_WARMUP, concurrency=1)
            if contender.module == "weclaw":
                publisher = App(
                    "bench-e2e-publisher",
                    settings=Settings(
                        amqp_url=SecretStr(self.infra.amqp_url),
                        redis_url=SecretStr(self.infra.redis_url),
                        results_enabled=contender.guard,
                        _env_file=None,  # type: ignore[call-arg]
                    ),
                )

            async def publish(seq: int) -> None:
                # The stamp is taken right before the publish call: publish -> handler start.
                payload = make_payload(seq, now_ns())
                task_id = f"{queue}-{seq}-{uuid.uuid4().hex[:6]}"
                if publisher is not None:
                    await publisher.publish(queue, payload, task_id=task_id)
                else:
                    await self.infra.publish_raw(queue, payload, task_id)

            async def drive(child: Child) -> None:
                await child.wait_for("consuming", 30)
                for _ in range(E2E_WARMUP):
                    await publish(-1)
                    await asyncio.sleep(interval)
                for seq in range(n):
                    await publish(seq)
                    await asyncio.sleep(interval)  # the worker is idle when the next arrives

            return await self.children.run(
                contender.module, cfg, queue, after_go=drive, done_timeout_s=60 + n * interval * 3
            )
        finally:
            if publisher is not None:
                await publisher.close()
            await self.infra.delete(queue)

    # -- cases ---------------------------------------------------------------------------
    async def _case(
        self,
        case_id: str,
        contenders: list[Contender],
        run: Callable[[Contender, int], Awaitable[dict[str, float]]],
    ) -> None:
        """Every repeat runs every contender, in an order rotated by one each repeat."""
        self.runners[case_id] = ({c.key: c for c in contenders}, run)
        if self.only:
            contenders = [c for c in contenders if c.key in self.only]
        if not contenders:
            return
        for repeat in range(self.repeats):
            shift = repeat % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                started = time.monotonic()
                try:
                    metrics = await run(contender, repeat)
                except ContenderFailed as e:
                    self.results.fail(case_id, contender.key, str(e))
                    log(f"[{case_id}] {contender.key} r{repeat + 1}: FAILED {e}")
                    continue
                self.results.record(case_id, contender.key, repeat, metrics)
                self.results.runs.append(
                    {"case": case_id, "contender": contender.key, "repeat": repeat, **metrics}
                )
                shown = ", ".join(f"{k}={v:,.3g}" for k, v in metrics.items())
                log(
                    f"[{case_id}] {contender.key} r{repeat + 1}/{self.repeats}: {shown} "
                    f"({time.monotonic() - started:.1f} s)"
                )

    def _spec(
        self,
        case_id: str,
        case_label: str,
        c: Contender,
        metric: str,
        unit: str,
        *,
        baseline: Contender | None = None,
        target: Target | None = None,
        decimals: int = 0,
    ) -> None:
        if self.only and c.key not in self.only:
            return  # left out with --only: no row
        self.results.add_spec(
            RowSpec(
                case_id=case_id,
                case_label=case_label,
                contender=c.key,
                contender_label=c.label,
                metric=metric,
                unit=unit,
                baseline=baseline.key if baseline else None,
                baseline_label=baseline.short if baseline else None,
                target=target,
                decimals=decimals,
            )
        )

    async def consume_cases(self) -> None:
        peers = [] if self.skip_peers else [FASTSTREAM, DRAMATIQ, DRAMATIQ_CLI]
        contenders = [RAW, WECLAW, RAW_REDIS, WECLAW_GUARD, WECLAW_GUARD_UVLOOP, *peers]
        for concurrency, count in self.counts.consume.items():
            case_id = f"consume-c{concurrency}"
            label = f"consume no-op, c={concurrency}"
            for c in contenders:
                baseline = RAW_REDIS if c is WECLAW_GUARD else (None if c is RAW else RAW)
                if c is WECLAW_GUARD_UVLOOP:
                    baseline = ASYNCIO_LOOP  # what the loop alone changes
                target = None
                if c is WECLAW and concurrency in (10, 100):
                    target = Target("ratio_min", 0.9, every=True)
                if c is WECLAW_GUARD:
                    # With its Redis calls auto-pipelined, the guard is to beat the same two
                    # scripts called by hand (issue 17), not only to match them.
                    target = Target("ratio_min", 1.5 if concurrency == 100 else 0.9)
                self._spec(case_id, label, c, "rate", "msg/s", baseline=baseline, target=target)
                if c is WECLAW_GUARD and concurrency == 100:
                    # ... and to keep most of the guard-off baseline's throughput.
                    self._spec(
                        case_id,
                        label,
                        c,
                        "rate",
                        "msg/s",
                        baseline=RAW,
                        target=Target("ratio_min", 0.6),
                    )
            for c in contenders:
                baseline = RAW_REDIS if c is WECLAW_GUARD else (None if c is RAW else RAW)
                if c is WECLAW_GUARD_UVLOOP:
                    baseline = ASYNCIO_LOOP
                self._spec(
                    case_id,
                    f"consumer CPU per message, c={concurrency}",
                    c,
                    "cpu_us",
                    "us CPU/msg",
                    baseline=baseline,
                )

            self._spec(
                case_id,
                f"Redis commands per round trip, c={concurrency}",
                WECLAW_GUARD,
                "redis_batch",
                "commands",
                decimals=1,
            )

            async def run(
                c: Contender, r: int, n: int = count, k: int = concurrency
            ) -> dict[str, float]:
                done = await self._consume(f"consume-c{k}", c, r, count=n, concurrency=k)
                return {"rate": done["rate"], "cpu_us": done["cpu_us"], **batching(done)}

            await self._case(case_id, contenders, run)

    async def processes_case(self) -> None:
        """Two worker processes under the supervisor against one, both guarded."""
        k = PROCESSES_CONCURRENCY
        count = 2 * self.counts.consume.get(k, max(self.counts.consume.values()))
        case_id = "processes"
        label = f"consume no-op, guard + results, c={k} per process"
        contenders = [WECLAW_GUARD, WECLAW_GUARD_PROCESSES]
        for c in contenders:
            two = c is WECLAW_GUARD_PROCESSES
            self._spec(
                case_id,
                label,
                c,
                "rate",
                "msg/s",
                baseline=WECLAW_GUARD if two else None,
                target=Target("ratio_min", 1.6) if two else None,
            )
        for c in contenders:
            self._spec(
                case_id,
                f"consumer CPU per message, guard + results, c={k} per process",
                c,
                "cpu_us",
                "us CPU/msg",
                baseline=WECLAW_GUARD if c is WECLAW_GUARD_PROCESSES else None,
            )

        # Where the cores went in each window: a second process can only add what the broker,
        # Redis and the first process leave free of this machine's cores.
        cores = [
            ("machine_cores", "cores busy, whole machine"),
            ("worker_cores", "cores used by the worker process(es)"),
            ("broker_cores", "cores used by the broker"),
            ("redis_cores", "cores used by Redis"),
        ]
        for metric, what in cores:
            for c in contenders:
                self._spec(
                    case_id,
                    f"{what} (of {os.cpu_count()}), guard + results, c={k} per process",
                    c,
                    metric,
                    "cores",
                    decimals=2,
                )

        async def run(c: Contender, r: int) -> dict[str, float]:
            done = await self._consume(case_id, c, r, count=count, concurrency=k)
            out = {"rate": done["rate"], "cpu_us": done["cpu_us"]}
            out["worker_cores"] = done["cpu_us"] * done["rate"] / 1e6
            out.update({m: done[m] for m, _ in cores if m in done})
            return out

        await self._case(case_id, contenders, run)

    async def io_cases(self) -> None:
        await self._io(self.counts.io_concurrency, self.counts.io_waves, target=True)

    async def io_high_cases(self) -> None:
        # No efficiency target: at thousands in flight the bound (c / 50 ms) is past what one
        # process consumes at all; the rows say what a guarded worker does there.
        await self._io(self.counts.io_high_concurrency, self.counts.io_high_waves, target=False)

    async def _io(self, concurrencies: tuple[int, ...], waves: int, *, target: bool) -> None:
        contenders = [RAW, WECLAW, WECLAW_GUARD]
        for concurrency in concurrencies:
            case_id = f"io-c{concurrency}"
            label = f"I/O 50 ms handler, c={concurrency}"
            bound = concurrency / SLEEP_S
            for c in contenders:
                self._spec(
                    case_id,
                    label,
                    c,
                    "efficiency",
                    f"x bound ({bound:,.0f}/s)",
                    baseline=None if c is RAW else RAW,
                    target=None if c is RAW or not target else Target("min", 0.9),
                    decimals=3,
                )

            async def run(c: Contender, r: int, k: int = concurrency) -> dict[str, float]:
                done = await self._consume(
                    f"io-c{k}",
                    c,
                    r,
                    count=k * waves,
                    concurrency=k,
                    sleep_s=SLEEP_S,
                )
                return {"efficiency": done["rate"] / (k / SLEEP_S), "rate": done["rate"]}

            await self._case(case_id, contenders, run)

    async def publish_cases(self) -> None:
        single = [PUB_RAW, PUB_WECLAW, PUB_WECLAW_RESULTS]
        label = "publish one at a time"
        for c in single:
            weclaw = c is not PUB_RAW
            base = None if c is PUB_RAW else PUB_RAW
            self._spec(
                "publish",
                label,
                c,
                "rate",
                "msg/s",
                baseline=base,
                target=Target("ratio_min", 0.9) if weclaw else None,
            )
            self._spec("publish", label, c, "p50_ms", "ms p50", baseline=base, decimals=2)
            self._spec(
                "publish",
                label,
                c,
                "p95_ms",
                "ms p95",
                baseline=base,
                decimals=2,
                target=Target("max", 1.5) if weclaw else None,
            )
            self._spec("publish", label, c, "p99_ms", "ms p99", baseline=base, decimals=2)

        async def one(c: Contender, r: int) -> dict[str, float]:
            done = await self._publish("publish", "publish", c, r, count=self.counts.publish)
            return {k: done[k] for k in ("rate", "p50_ms", "p95_ms", "p99_ms")}

        await self._case("publish", single, one)

        many = [MANY_RAW, MANY_WECLAW, MANY_WECLAW_RESULTS]
        label = "publish_many, batches of 100"
        for c in many:
            weclaw = c is not MANY_RAW
            base = None if c is MANY_RAW else MANY_RAW
            self._spec(
                "publish-many",
                label,
                c,
                "rate",
                "msg/s",
                baseline=base,
                target=Target("ratio_min", 0.9) if weclaw else None,
            )
            self._spec(
                "publish-many",
                label,
                c,
                "p50_ms",
                "ms per 100 (median batch)",
                baseline=base,
                decimals=1,
            )

        async def batches(c: Contender, r: int) -> dict[str, float]:
            count = 100 * self.counts.publish_many_batches
            done = await self._publish("publish-many", "publish_many", c, r, count=count)
            return {"rate": done["rate"], "p50_ms": done["p50_ms"]}

        await self._case("publish-many", many, batches)

    async def rss_case(self) -> None:
        peers = [] if self.skip_peers else [FASTSTREAM, DRAMATIQ]
        contenders = [RAW, WECLAW, WECLAW_GUARD, *peers]
        label = f"idle worker RSS (c=10, after {self.counts.rss} messages)"
        # Guard off: no redis-py loaded; guard + results (and the per-message metrics): the
        # store and redis-py on top.
        targets = {WECLAW.key: Target("max", 40), WECLAW_GUARD.key: Target("max", 45)}
        for c in contenders:
            self._spec(
                "rss",
                label,
                c,
                "rss_mib",
                "MiB",
                baseline=None if c is RAW else RAW,
                target=targets.get(c.key),
                decimals=1,
            )

        async def run(c: Contender, r: int) -> dict[str, float]:
            done = await self._consume(
                "rss", c, r, count=self.counts.rss, concurrency=10, idle_rss=True
            )
            return {"rss_mib": done["rss_mib"]}

        await self._case("rss", contenders, run)

    async def e2e_case(self) -> None:
        contenders = [RAW, WECLAW, WECLAW_GUARD]
        label = "publish -> handler start, idle worker"
        for c in contenders:
            base = None if c is RAW else RAW
            self._spec("e2e", label, c, "p50_ms", "ms p50", baseline=base, decimals=2)
            self._spec("e2e", label, c, "p95_ms", "ms p95", baseline=base, decimals=2)

        async def run(c: Contender, r: int) -> dict[str, float]:
            done = await self._e2e("e2e", c, r)
            return {"p50_ms": done["p50_ms"], "p95_ms": done["p95_ms"]}

        await self._case("e2e", contenders, run)

    async def run_all(self) -> None:
        steps = {
            "consume": self.consume_cases,
            "processes": self.processes_case,
            "io": self.io_cases,
            "io-high": self.io_high_cases,
            "publish": self.publish_cases,
            "rss": self.rss_case,
            "e2e": self.e2e_case,
        }
        for name in (*CASES, *EXTRA_CASES):
            if name in self.cases:
                await steps[name]()


def batching(done: dict[str, Any]) -> dict[str, float]:
    """The guarded worker's Redis commands per round trip (its auto-pipeline), if it has one."""
    if "redis_per_round_trip" not in done:
        return {}
    return {"redis_batch": done["redis_per_round_trip"]}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def notes(counts: Counts, skip_peers: bool) -> list[str]:
    out = [
        "Repeats: each repeat runs every contender of a case once, in an order rotated by one "
        "each repeat; median, min and max are over the repeats. Ratios are paired: repeat i of "
        "a contender over repeat i of its baseline (the same rotated round, so the same "
        "machine load), shown as the median of those per-repeat ratios with their min-max. A "
        "target is met when it holds for the median (the median paired ratio, or the median "
        "value for an absolute target); the result also says in how many repeats it held.",
        "Every contender runs in its own process; consume throughput is timed from the first "
        "delivery to the last ack on a queue pre-filled with pipelined confirmed publishes "
        "(1 KiB persistent JSON, quorum queue with weclaw_mq's arguments, prefetch = "
        "concurrency, manual ack after the handler). The delivery and ack hooks are the same "
        "patch of aio-pika's IncomingMessage for raw, weclaw_mq and FastStream.",
        "Redis per message: weclaw_mq with guard + results makes 2 script calls (EVALSHA): "
        "the claim script (SET NX PX and the 'running' record) and the finish script (the "
        "result record and the done marker). 'raw aio-pika + Redis by hand' calls the very "
        "same two scripts (their text imported from weclaw_mq, registered with redis-py's "
        "register_script, the same KEYS and ARGV, keys from weclaw_mq.contract.naming), in the "
        "same order, with a record JSON it builds by hand; it checks after the run that they "
        "stored a succeeded record and the done marker. So Redis does the same work for both, and "
        "the difference between the two rows is weclaw_mq's own overhead.",
        "raw aio-pika does what weclaw_mq's worker does: one task per delivery, json.loads of "
        "the body, the handler, ack; its messages carry the same properties and headers. "
        "Both use redis-py's default ConnectionPool.",
        "weclaw_mq runs as users run it: App + Worker(app, concurrency=N), its default "
        "per-message trace context and Prometheus metrics on; 'guard off' = settings "
        "results_enabled=False and handler(idempotent=False).",
        "'consumer CPU per message' is the consumer process's CPU time (all threads) between "
        "first delivery and last ack, divided by the messages: much less sensitive to a busy "
        "machine than msg/s.",
        "I/O efficiency = measured msg/s / (concurrency / 0.05 s).",
        "publish: one message is published before the clock starts (warm connections, also "
        "Redis with results on). The publishing weclaw_mq App has the queue's handler "
        "registered, with a pydantic model of the payload (seq: int, sent_ns: int, pad: str), "
        "and publishes dicts: every publish validates its payload against that model (as "
        "App.publish does for a queue whose handler it knows); raw aio-pika validates nothing. "
        "publish_many msg/s covers all batches; 'ms per 100' is the median batch.",
        "e2e: stamp (CLOCK_MONOTONIC, shared by all processes) taken just before the publish "
        f"call, read at handler start; {E2E_WARMUP} warm-up messages are not counted; one "
        f"message every {counts.e2e_interval_s * 1000:g} ms so the worker is idle.",
        "RSS: VmRSS from /proc/PID/status 1 s after the last ack, in MiB (VmRSS kB / 1024); "
        "the 40 MB target is checked against MiB.",
    ]
    if skip_peers:
        out.append("FastStream and Dramatiq were skipped (--skip-peers).")
    else:
        out += [
            "FastStream: RabbitBroker, RabbitQueue(queue_type=QUORUM, same arguments), "
            "Channel(prefetch_count=concurrency), AckPolicy.REJECT_ON_ERROR (ack after the "
            "handler), logger=None (its default logs two lines per message).",
            "Dramatiq: RabbitmqBroker declares its own queues (Q, Q.DQ, Q.XQ); a subclass adds "
            "x-queue-type=quorum to Q and Q.DQ (Q.XQ stays classic, unused here). Sync actor; "
            "default middleware; its messages are its own JSON format padded to 1 KiB. Its "
            "first-delivery hook is before_process_message, its ack hook after_ack. Two modes: "
            "'1 process, threads = c': one Worker, worker_threads = prefetch = the case's "
            f"concurrency, like every other contender; '{DRAMATIQ_PROCESSES} processes x "
            f"{DRAMATIQ_THREADS} threads': what its docs recommend, the dramatiq CLI's defaults "
            "(one process per CPU, 8 threads, prefetch twice the threads, processes forked), "
            "the same for every c. There the window runs from the first delivery in any process "
            "to the last ack in any process (the ack count is shared memory under one "
            "cross-process lock), and CPU per message is the sum of the worker processes' CPU, "
            "each from its own first delivery to the last ack. It has no RSS row (several "
            "processes).",
        ]
    return out
