"""The console's audit log: one line per mutating action, on logger
``weclaw_mq.console.audit``, saying who (the client's address and the token's fingerprint,
never the token) and what (the action, the queue, the task ids or the filter, the outcome).

A line is written when the action ends, whatever its outcome (a bulk requeue or purge: when
its background job ends, with its summary), and also when it was refused
(``outcome=refused``), so a log collector sees every attempt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

log = logging.getLogger("weclaw_mq.console.audit")

# The most task ids one line names; the rest are counted.
IDS_LISTED_MAX = 50


def audit_line(client: str, who: str, action: str, what: Mapping[str, object]) -> str:
    """``console audit client=... who=... action=... key=value ...`` (values as JSON, so a
    value with spaces or quotes stays one field)."""
    fields = [f"client={client}", f"who={who}", f"action={action}"]
    for key, value in what.items():
        if isinstance(value, (list, tuple, set, frozenset)):
            values = sorted(str(v) for v in value)
            shown: object = values[:IDS_LISTED_MAX]
            if len(values) > IDS_LISTED_MAX:
                fields.append(f"{key}_count={len(values)}")
            value = shown
        fields.append(f"{key}={json.dumps(value, default=str, separators=(',', ':'))}")
    return "console audit " + " ".join(fields)


def audit(client: str, who: str, action: str, **what: object) -> None:
    """Write one audit line (level INFO)."""
    log.info("%s", audit_line(client, who, action, what))
