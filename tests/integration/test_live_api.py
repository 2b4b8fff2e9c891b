"""The example API's event endpoints over a real HTTP connection (uvicorn, httpx): a task's
stream and a session's inbox as Server-Sent Events, resumed with ``Last-Event-ID``."""

from __future__ import annotations

import socket

import httpx

from consumers import demo
from producers.api import RETRY_AFTER_S, create_app
from tests.conftest import settings_for, wait_until
from tests.integration.dead_endpoints import closed_port
from tests.integration.live_app import LiveApi, live_api, steady_llm  # noqa: F401
from tests.integration.live_server import Frame, read_events
from weclaw_mq import App
from weclaw_mq.streaming.events import chunk_entry, encode_data


def chunks_text(events: list[Frame], task_id: str) -> str:
    """The text a client shows for ``task_id``: the chunks after its last attempt marker."""
    text = ""
    for e in events:
        if e.data["task_id"] != task_id:
            continue
        if e.event == "attempt":
            text = ""
        elif e.event == "chunk":
            text += e.data["data"]
    return text


def assert_ordered(events: list[Frame]) -> None:
    keys = [tuple(int(p) for p in e.id.split("-")) for e in events]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), [e.id for e in events]


async def test_task_events_stream_the_chunks_then_the_final_event_and_end(
    live_api: LiveApi,  # noqa: F811
) -> None:
    task_id = await live_api.post("stream me")
    # Read from the moment it is accepted: the events come live, and the response ends
    # by itself after the final event.
    events = await read_events(live_api.client, f"/tasks/{task_id}/events")

    kinds = [e.event for e in events]
    assert kinds[0] == "attempt" and kinds[-1] == "final", kinds
    assert set(kinds[1:-1]) == {"chunk"}, kinds
    assert len(kinds) == 2 + len(demo.words_of(demo.reply_to("stream me")))
    assert chunks_text(events, task_id) == demo.reply_to("stream me")
    assert events[-1].data["status"] == "succeeded"
    assert events[-1].data["result"]["reply"] == demo.reply_to("stream me")
    assert_ordered(events)
    assert all(e.data["id"] == e.id for e in events)


async def test_task_events_resumed_after_any_event_id_give_exactly_the_rest(
    live_api: LiveApi,  # noqa: F811
) -> None:
    task_id = await live_api.post("resume me")
    await live_api.worker_app.result(task_id, timeout_s=20)
    url = f"/tasks/{task_id}/events"
    everything = await read_events(live_api.client, url)

    # After the final's id the answer is empty and ends at once.
    for i, seen in enumerate(everything):
        rest = await read_events(live_api.client, url, headers={"Last-Event-ID": seen.id})
        assert rest == everything[i + 1 :], f"resumed after event {i} ({seen.id})"
    # A reloaded page passes the id it kept as a query parameter (EventSource sets no headers).
    by_query = await read_events(live_api.client, url, params={"last_event_id": everything[2].id})
    assert by_query == everything[3:]


async def test_task_events_answer_404_for_an_unknown_task_and_422_for_a_bad_event_id(
    live_api: LiveApi,  # noqa: F811
) -> None:
    task_id = await live_api.post("known")
    unknown = await live_api.client.get(f"/tasks/nobody-published-{live_api.queue}/events")
    bad_id = await live_api.client.get(
        f"/tasks/{task_id}/events", headers={"Last-Event-ID": "yesterday"}
    )
    bad_session = await live_api.client.get("/sessions/no{braces}/events")
    no_id = await live_api.client.post("/sessions/someone/confirm", json={"last_event_id": ""})

    assert unknown.status_code == 404, unknown.text
    assert bad_id.status_code == 422 and "yesterday" in bad_id.text, bad_id.text
    assert bad_session.status_code == 422, bad_session.text
    assert no_id.status_code == 422, no_id.text


async def test_event_endpoints_answer_503_with_retry_after_when_redis_does_not_answer(
    broker_url: str, qname: str
) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    mq = App("demo-api", settings=settings_for(broker_url, url, redis_timeout_s=1))
    demo.register(mq, queue=qname)
    async with (
        mq,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(mq)), base_url="http://api"
        ) as client,
    ):
        answers = [
            await client.get(f"/tasks/some-task-{qname}/events"),
            await client.get("/sessions/someone/events", headers={"Last-Event-ID": "1-0"}),
            await client.post("/sessions/someone/confirm", json={"last_event_id": "1-0"}),
        ]

    for response in answers:
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert "unavailable" in response.json()["detail"]["message"]


async def test_a_session_keeps_replies_until_the_client_shows_it_has_them(
    live_api: LiveApi,  # noqa: F811
) -> None:
    session = live_api.session("reader")
    prompts = ["first question", "second question", "third question"]
    tasks = [await live_api.post(p, session_id=session) for p in prompts]
    for task_id in tasks:
        await live_api.worker_app.result(task_id, timeout_s=20)
    url = f"/sessions/{session}/events"

    # Nobody was connected, so everything waited. The first connection drops after 5
    # events, with later frames already written to it (the server writes what it has) but
    # never read: written is not received.
    dropped = await read_events(live_api.client, url, limit=5)
    # Resuming after the last event the client has gives exactly the rest: with the
    # dropped frames, every reply complete, oldest first.
    rest = await read_events(
        live_api.client, url, headers={"Last-Event-ID": dropped[-1].id}, until_finals=3
    )
    waiting = dropped + rest
    assert_ordered(waiting)
    assert [e.data["task_id"] for e in waiting if e.event == "final"] == tasks
    for task_id, prompt in zip(tasks, prompts, strict=True):
        assert chunks_text(waiting, task_id) == demo.reply_to(prompt)
    # The resume confirmed what came before its id. A client that does not say what it has
    # gets everything not confirmed yet again: nothing was confirmed for being written.
    again = await read_events(live_api.client, url, until_finals=3)
    assert again == rest
    # A confirm of the rest leaves nothing pending.
    confirm = await live_api.client.post(
        f"/sessions/{session}/confirm", json={"last_event_id": rest[-1].id}
    )
    assert confirm.status_code == 204, confirm.text

    # A new reply is the first thing a new connection receives.
    later = await live_api.post("fourth question", session_id=session)
    fresh = await read_events(live_api.client, url, until_finals=1)
    assert {e.data["task_id"] for e in fresh} == {later}, fresh
    assert chunks_text(fresh, later) == demo.reply_to("fourth question")


async def fill_inbox(live_api: LiveApi, session: str, count: int) -> None:  # noqa: F811
    """``count`` chunks of 2 kB waiting in the session's inbox (several MB: more than the
    socket buffers between a server and a client hold)."""
    entries = [chunk_entry(f"t-{n}", 1, encode_data("w" * 2000)) for n in range(count)]
    for start in range(0, count, 500):
        await live_api.worker_app.streams.deliver(session, entries[start : start + 500])


def stalled_client(base_url: str, path: str) -> socket.socket:
    """A client that asks for ``path`` and then never reads (its receive buffer small)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: api\r\n\r\n".encode())
    return sock


async def test_a_client_that_never_reads_is_dropped_its_buffer_bounded_and_others_get_all(
    live_api: LiveApi,  # noqa: F811
) -> None:
    streams = live_api.streams
    streams.stall_s = 2.0
    session = live_api.session("stalled")
    count = 3000
    await fill_inbox(live_api, session, count)
    url = f"/sessions/{session}/events"

    with stalled_client(live_api.base_url, url):
        await wait_until(lambda: streams.dropped == 1, 30, "the stalled client to be dropped")
        # Its frames waited in a bounded buffer while its socket was full, then were let go.
        assert 0 < streams.peak_buffered <= streams.buffer_bytes
        await wait_until(lambda: streams.open == 0, 10, "the stalled response to end")
        # A client that reads gets every event, in order, and is not dropped.
        got = await read_events(live_api.client, url, limit=count, timeout_s=60)
    assert [e.data["task_id"] for e in got] == [f"t-{n}" for n in range(count)]
    assert_ordered(got)
    assert streams.dropped == 1


async def test_a_client_that_closes_without_reading_is_cleaned_up_at_once(
    live_api: LiveApi,  # noqa: F811
) -> None:
    streams = live_api.streams
    streams.stall_s = 3600.0  # so it is the close that ends the response, not a drop
    session = live_api.session("closer")
    await fill_inbox(live_api, session, 3000)
    sock = stalled_client(live_api.base_url, f"/sessions/{session}/events")
    await wait_until(lambda: streams.peak_buffered > 0, 20, "the response to start")
    assert streams.open == 1
    sock.close()
    await wait_until(lambda: streams.open == 0, 20, "the closed client's response to end")
    assert streams.dropped == 0
