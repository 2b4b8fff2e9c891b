"""``WorkflowStore`` on Redis: every step one Lua script over the workflow's own keys.

The keys (``naming.workflow_key``, ``naming.workflow_parts_key``) are hash-tagged on the
workflow id, so each script touches one slot of a cluster; the deadlines' sorted set
(``naming.WORKFLOW_DEADLINES_KEY``) is one key of its own, touched in steps of its own. A
group's join is one script per part (an ``HSETNX`` of its outcome by index, then an
``HINCRBY`` of the parts left): O(1) whatever the group's size, so the join of a large group
costs each part one round trip, shared with the other Redis commands of its loop iteration
(``pipelining.AutoPipeline``). Only the part that completes the join reads every outcome, once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from weclaw_mq.contract.naming import WORKFLOW_DEADLINES_KEY, workflow_key, workflow_parts_key
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.redis_clients import StateClient
from weclaw_mq.state.workflow_records import (
    MISSING_LISTED,
    Answer,
    Progress,
    answer_of,
)

_CREATE = Script.of("""
local plan = redis.call('HGET', KEYS[1], 'plan')
if plan then return plan end
redis.call('HSET', KEYS[1], 'plan', ARGV[1], 'kind', ARGV[2], 'size', ARGV[3],
  'policy', ARGV[4], 'state', 'running', 'stage', 0, 'published', -1, 'left', ARGV[3],
  'keep', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return ARGV[1]
""")

# The end of a workflow, shared by the scripts that may end it: the first one wins.
_ENDED_LUA = """
local function ended(key, outcome)
  local state = redis.call('HGET', key, 'state')
  local plan = redis.call('HGET', key, 'plan')
  if state ~= 'ended' and outcome ~= '' then
    redis.call('HSET', key, 'state', 'ended', 'outcome', outcome)
    return {'ended', outcome, '1', plan}
  end
  return {'ended', redis.call('HGET', key, 'outcome') or '', '0', plan}
end
"""

_CHAIN_STEP = Script.of(
    _ENDED_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state ~= 'running' then return ended(KEYS[1], '') end
local index = tonumber(ARGV[1])
local published = tonumber(redis.call('HGET', KEYS[1], 'published'))
if published < index then
  published = index
  redis.call('HSET', KEYS[1], 'published', index)
end
if ARGV[3] == '1' and index + 1 < tonumber(redis.call('HGET', KEYS[1], 'size')) then
  if published >= index + 1 then return {'published'} end
  if tonumber(redis.call('HGET', KEYS[1], 'stage')) < index + 1 then
    redis.call('HSET', KEYS[1], 'stage', index + 1)
  end
  return {'next', redis.call('HGET', KEYS[1], 'plan')}
end
if index < tonumber(redis.call('HGET', KEYS[1], 'stage')) then return {'published'} end
return ended(KEYS[1], ARGV[2])
"""
)

_MARK_PUBLISHED = Script.of("""
local published = redis.call('HGET', KEYS[1], 'published')
if published and tonumber(published) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'published', ARGV[1])
end
return 1
""")

_JOIN = Script.of(
    _ENDED_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state == 'ended' then return ended(KEYS[1], '') end
if state == 'joined' then
  if redis.call('HGET', KEYS[1], 'published') == '1' then return {'counted'} end
  return {'joined'}
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return {'counted'} end
redis.call('PEXPIRE', KEYS[2], redis.call('HGET', KEYS[1], 'keep'))
local left = redis.call('HINCRBY', KEYS[1], 'left', -1)
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'policy') == 'fail' then
  return ended(KEYS[1], ARGV[3])
end
if left <= 0 then
  redis.call('HSET', KEYS[1], 'state', 'joined')
  return {'joined'}
end
return {'counted'}
"""
)

_END = Script.of(
    _ENDED_LUA
    + """
if not redis.call('HGET', KEYS[1], 'state') then return {'unknown'} end
return ended(KEYS[1], ARGV[1])
"""
)

_EXPIRE = Script.of(
    _ENDED_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if state == 'ended' then return ended(KEYS[1], '') end
local missing, count = {}, 0
if redis.call('HGET', KEYS[1], 'kind') == 'group' and state == 'running' then
  local listed = tonumber(ARGV[1])
  for i = 0, tonumber(redis.call('HGET', KEYS[1], 'size')) - 1 do
    if redis.call('HEXISTS', KEYS[2], tostring(i)) == 0 then
      count = count + 1
      if #missing < listed then missing[#missing + 1] = i end
    end
  end
end
local outcome = cjson.encode({status = 'expired', by = 'deadline', was = state,
  stage = tonumber(redis.call('HGET', KEYS[1], 'stage')), missing = missing,
  missing_count = count})
return ended(KEYS[1], outcome)
"""
)

# The deadlines' sorted set through the auto-pipeline too (its lean path, one batch with the
# other commands of the loop iteration), not a command of the client's own.
_ADD_DEADLINE = Script.of("return redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[2])")
_FORGET_DEADLINE = Script.of("return redis.call('ZREM', KEYS[1], ARGV[1])")
_SWEEP_SOON = Script.of("return redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[2])")

_DUE = Script.of("""
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[3]), id)
end
return ids
""")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisWorkflowStore:
    """``WorkflowStore`` in the task store's Redis, sharing its auto-pipeline.

    Args:
        client: The redis-py client.
        pipe: The task store's auto-pipeline.
    """

    def __init__(self, client: StateClient, pipe: AutoPipeline) -> None:
        self._redis = client
        self._pipe = pipe

    async def _script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._pipe.script(script, keys, args)
        except Exception as e:
            raise state_unavailable(e) from e

    async def create(
        self,
        workflow_id: str,
        plan: str,
        *,
        kind: str,
        size: int,
        policy: str,
        deadline_ms: int,
        keep_ms: int,
    ) -> str:
        # Together: a deadline whose workflow was never stored is dropped by the sweep that
        # finds it, and no hop runs before ``create`` returned (nothing is published before).
        try:
            _, stored = await asyncio.gather(
                self._pipe.script(
                    _ADD_DEADLINE, [WORKFLOW_DEADLINES_KEY], [deadline_ms, workflow_id]
                ),
                self._pipe.script(
                    _CREATE, [workflow_key(workflow_id)], [plan, kind, size, policy, keep_ms]
                ),
            )
        except Exception as e:
            raise state_unavailable(e) from e
        return _text(stored)

    async def plan(self, workflow_id: str) -> str | None:
        try:
            plan = await self._pipe.hget(workflow_key(workflow_id), "plan")
        except Exception as e:
            raise state_unavailable(e) from e
        return None if plan is None else _text(plan)

    async def chain_step(
        self, workflow_id: str, index: int, outcome: Mapping[str, Any], *, succeeded: bool
    ) -> Answer:
        reply = await self._script(
            _CHAIN_STEP,
            [workflow_key(workflow_id)],
            [index, json.dumps(outcome), "1" if succeeded else "0"],
        )
        return answer_of(reply)

    async def mark_published(self, workflow_id: str, index: int) -> None:
        await self._script(_MARK_PUBLISHED, [workflow_key(workflow_id)], [index])

    async def join(
        self,
        workflow_id: str,
        index: int,
        outcome: Mapping[str, Any],
        *,
        ends_group: Mapping[str, Any] | None,
    ) -> Answer:
        reply = await self._script(
            _JOIN,
            [workflow_key(workflow_id), workflow_parts_key(workflow_id)],
            [index, json.dumps(outcome), "" if ends_group is None else json.dumps(ends_group)],
        )
        return answer_of(reply)

    async def parts(self, workflow_id: str) -> dict[int, dict[str, Any]]:
        try:
            raw = await self._redis.hgetall(workflow_parts_key(workflow_id))
        except Exception as e:
            raise state_unavailable(e) from e
        return {int(_text(k)): json.loads(_text(v)) for k, v in raw.items()}

    async def end(self, workflow_id: str, outcome: Mapping[str, Any]) -> Answer:
        reply = await self._script(_END, [workflow_key(workflow_id)], [json.dumps(outcome)])
        return answer_of(reply)

    async def expire(self, workflow_id: str) -> Answer:
        reply = await self._script(
            _EXPIRE,
            [workflow_key(workflow_id), workflow_parts_key(workflow_id)],
            [MISSING_LISTED],
        )
        return answer_of(reply)

    async def progress(self, workflow_id: str) -> Progress | None:
        try:
            meta = await self._redis.hgetall(workflow_key(workflow_id))
            ended = await self._redis.hkeys(workflow_parts_key(workflow_id))
        except Exception as e:
            raise state_unavailable(e) from e
        fields = {_text(k): _text(v) for k, v in meta.items()}
        if "plan" not in fields:
            return None
        return Progress(
            fields["plan"],
            fields["state"],
            int(fields["stage"]),
            frozenset(int(_text(i)) for i in ended),
        )

    async def due(self, now_ms: int, *, limit: int, lease_ms: int) -> list[str]:
        reply = await self._script(_DUE, [WORKFLOW_DEADLINES_KEY], [now_ms, limit, lease_ms])
        return [_text(w) for w in reply]

    async def forget_deadline(self, workflow_id: str) -> None:
        await self._script(_FORGET_DEADLINE, [WORKFLOW_DEADLINES_KEY], [workflow_id])

    async def sweep_soon(self, workflow_id: str, at_ms: int) -> None:
        await self._script(_SWEEP_SOON, [WORKFLOW_DEADLINES_KEY], [at_ms, workflow_id])
