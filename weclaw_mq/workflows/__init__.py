"""Workflows: chains (stages one after another) and groups (parts side by side, then one
callback), durable in the task store and ended by their deadline at the latest.

``plans`` (what a workflow is, pure), ``starting`` (``App.chain``, ``App.group``,
``App.cancel_workflow``), ``hops`` (a task's end reported to its workflow, before its ack)
and ``deadlines`` (the sweep that ends overdue workflows).
"""

from weclaw_mq.workflows.plans import PartResult, Stage

__all__ = ["PartResult", "Stage"]
