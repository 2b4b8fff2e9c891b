"""``App``'s workflow and cost methods: chains and groups (``workflows.starting``) and what
the reported model usage cost (``state.cost_ledger``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from weclaw_mq.contract.task_ids import check_task_id
from weclaw_mq.settings import Settings
from weclaw_mq.state import Cancellation
from weclaw_mq.state.cost_ledger import Call, CostLedger, Totals, ledger_of
from weclaw_mq.workflows.host import Host
from weclaw_mq.workflows.plans import Stage
from weclaw_mq.workflows.starting import cancel_workflow, start_chain, start_group


class WorkflowsAndCosts:
    """Chains, groups and costs (``App`` inherits these methods)."""

    # Set by App.__init__.
    name: str
    settings: Settings

    def _host(self) -> Host:
        # This class is a part of the App, which is the workflows' Host.
        return cast(Host, self)

    async def chain(
        self,
        stages: Sequence[str | Stage],
        payload: Any,
        *,
        chain_id: str | None = None,
        trace_id: str | None = None,
        session_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Start a chain: each stage's result becomes the next stage's payload.

        Each stage is a normal handler (its own queue, retries, limits, priority); stage ``i``
        runs as task ``<chain id>.<i>``, with the chain's trace id and session. The chain's
        record (``status``, ``result``, ``stream``: the chain id, no queue) ends with the last
        stage's result, or with the first stage that did not succeed (its status, and a reason
        naming it), or ``expired`` at its deadline.

        Args:
            stages: The stages in order: handler queue names, or
                ``weclaw_mq.workflows.Stage(queue, priority=...)``.
            payload: The first stage's payload.
            chain_id: The chain's id (an idempotency key: starting it again publishes
                nothing new); default a new one.
            trace_id: The trace id of every stage; default a new one.
            session_id: The session of every stage (their chunks and finals go to its inbox).
            deadline_s: How long the chain may take before it is ended ``expired``; default
                ``settings.workflow_deadline_s``.

        Returns:
            The chain id, once its first stage is confirmed.

        Raises:
            ConfigurationError: No stages, a bad queue name, id, session id or deadline, an
                id used before for another workflow, or results off.
            PayloadError: As ``publish`` raises it, for the first stage.
            PublishFailedError: As ``publish`` raises it (start it again with the same id).
        """
        return await start_chain(
            self._host(),
            stages,
            payload,
            chain_id=chain_id,
            trace_id=trace_id,
            session_id=session_id,
            deadline_s=deadline_s,
        )

    async def group(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        then: str | Stage | None = None,
        on_failure: str = "fail",
        group_id: str | None = None,
        trace_id: str | None = None,
        session_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Start a group: one part per payload, then one callback with their results in order.

        Part ``i`` runs as task ``<group id>.<i>``; once every part has ended (succeeded,
        dead-lettered, expired or cancelled) the callback runs once, as task ``<group
        id>.then``. The group's record (``result(group id)``) ends with the callback's end
        (without a callback: the parts' results), with the first failed part under
        ``on_failure="fail"``, or ``expired`` at its deadline, naming the parts missing.

        Args:
            queue: The handler queue of the parts.
            payloads: One payload per part (published in batches of 1,000).
            then: The callback's handler queue (or a ``Stage``); None for no callback.
            on_failure: ``"fail"``: a part that does not succeed ends the group (the
                callback does not run) and the callback receives the parts' results;
                ``"pass"``: the callback receives every part's end as a
                ``weclaw_mq.workflows.PartResult``.
            group_id: The group's id (an idempotency key); default a new one.
            trace_id: The trace id of every part and the callback; default a new one.
            session_id: The session of every part and the callback.
            deadline_s: How long the group may take; default
                ``settings.workflow_deadline_s``.

        Returns:
            The group id, once every part is confirmed.

        Raises:
            ConfigurationError: No parts, an unknown policy, a bad name, id or deadline, an
                id used before for another workflow, or results off.
            PayloadError: As ``publish_many`` raises it, before anything is sent.
            BatchPublishError: Some parts were not confirmed (start it again with the same
                id).
        """
        return await start_group(
            self._host(),
            queue,
            payloads,
            then=then,
            on_failure=on_failure,
            group_id=group_id,
            trace_id=trace_id,
            session_id=session_id,
            deadline_s=deadline_s,
        )

    async def cancel_workflow(self, workflow_id: str) -> Cancellation:
        """Cancel a chain or group and its tasks still to come.

        The workflow's record becomes ``cancelled``; a chain's current and later stages, and a
        group's parts that have not ended and its callback, are cancelled as ``cancel`` does
        (a running one within about a second; one not published yet when it comes).

        Args:
            workflow_id: The chain or group id.

        Returns:
            ``cancelled``; ``finished`` when it had ended (its record unchanged); ``unknown``.

        Raises:
            ConfigurationError: Results are off.
            StateUnavailableError: The store fails or does not answer.
        """
        return await cancel_workflow(self._host(), workflow_id)

    # -- costs (weclaw_mq.policy.costs) ----------------------------------------------------
    def _ledger(self) -> CostLedger:
        return ledger_of(
            self._host().store,
            self.name,
            usage_ttl_s=self.settings.result_ttl_s,
            days_kept=self.settings.cost_days_kept,
        )

    async def costs(self, *, days: int = 1, by: str = "tenant") -> list[Totals]:
        """What the reported model usage cost over the last ``days`` UTC days.

        Args:
            days: How many days back, today included.
            by: ``"tenant"`` or ``"model"``.

        Returns:
            One ``Totals`` (cost, input and output tokens) per tenant or model, the most
            expensive first.

        Raises:
            ConfigurationError: ``by`` is neither, or the App keeps no Redis task store.
            StateUnavailableError: Redis does not answer.
        """
        return await self._ledger().totals(days, by=by)

    async def calls(self, task_id: str) -> list[Call]:
        """Every model call recorded on a task (each attempt's), with its tokens and cost.

        Args:
            task_id: The task's id.

        Returns:
            The calls, oldest first; none when it reported none (or its record expired).

        Raises:
            ConfigurationError: A task id no task can have, or the App keeps no Redis task
                store.
            StateUnavailableError: Redis does not answer.
        """
        check_task_id(task_id)  # as cancel and result: '' is a mistake, not a task of no calls
        return await self._ledger().calls_of(task_id)
