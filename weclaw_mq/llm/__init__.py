"""The LLM layer's door: what a handler of model calls adds beside the core path.

``from weclaw_mq.llm import ...`` gives limits by tokens and requests (``Limit``), prices per
model and a tenant's daily cap (``Price``, ``Cap``), model fallback chains (``Fallback``),
fair share across tenants (``Fair``), and what a run's model calls reported (``Usage``). The
core path (``App``, ``Context``, ``Worker``, ``Reject``, ``Retry``, ``Middleware``, ``Defer``)
is ``from weclaw_mq import ...``. See docs/how-to/limits.md, costs.md, fallbacks.md and
fair-share.md.
"""

from __future__ import annotations

from weclaw_mq.handlers.middleware import Usage
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.policy.fair_share import Fair
from weclaw_mq.policy.fallback import Fallback
from weclaw_mq.policy.limits import Limit

__all__ = ["Cap", "Fair", "Fallback", "Limit", "Price", "Usage"]
