"""Handler registration fails at decoration time; parsing tells undecodable from invalid."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, SecretStr, field_validator

from weclaw_mq import (
    App,
    ConfigurationError,
    Context,
    PayloadValidationError,
    RetryPolicy,
    Settings,
)
from weclaw_mq.errors import InvalidPayload, UndecodableBody
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.settings import redact_url


class Prompt(BaseModel):
    text: str
    max_tokens: int = 64


def _app() -> App:
    # No broker is touched: registration and parsing are pure.
    return App("unit", settings=Settings(amqp_url=SecretStr("amqp://guest:guest@127.0.0.1:1/")))


def test_handler_is_registered_with_its_options() -> None:
    app = _app()
    policy = RetryPolicy(max_retries=1, delay_s=0.1)

    @app.handler("summarise", retry=policy, timeout_s=2.5, delivery_limit=4, max_length=9)
    async def summarise(task: Prompt, ctx: Context) -> None:
        return None

    spec = app.handlers["summarise"]
    assert spec.func is summarise
    assert spec.takes_context is True
    assert spec.retry is policy
    assert (spec.timeout_s, spec.delivery_limit, spec.max_length) == (2.5, 4, 9)
    # Its policy's delay, then the step queues that serve any other delay.
    assert spec.queue_spec().retry_delays_ms == (100, *STEP_DELAYS_MS)


def test_options_left_out_come_from_settings() -> None:
    app = App(
        "unit",
        settings=Settings(
            max_retries=2,
            retry_delay_s=0.5,
            retry_multiplier=3,
            handler_timeout_s=7,
            delivery_limit=5,
        ),
    )

    @app.handler("summarise")
    async def summarise(task: Prompt) -> None:
        return None

    spec = app.handlers["summarise"]
    assert spec.takes_context is False
    assert spec.retry.delays_ms() == (500, 1_500)
    assert (spec.timeout_s, spec.delivery_limit, spec.max_length) == (7, 5, None)


def test_handler_without_retries_still_gets_the_first_delay_queue() -> None:
    # the idempotency guard parks duplicates of a running task there, retries or not
    app = _app()

    @app.handler("summarise", retry=RetryPolicy(max_retries=0, delay_s=0.05))
    async def summarise(task: Prompt) -> None:
        return None

    assert app.handlers["summarise"].queue_spec().retry_delays_ms == (50, *STEP_DELAYS_MS)


def test_decorator_returns_the_function_unchanged() -> None:
    app = _app()

    async def summarise(task: Prompt) -> None:
        return None

    assert app.handler("summarise")(summarise) is summarise


def test_second_handler_for_the_same_queue_is_refused() -> None:
    app = _app()

    @app.handler("summarise")
    async def first(task: Prompt) -> None:
        return None

    with pytest.raises(ConfigurationError, match="already has a handler"):

        @app.handler("summarise")
        async def second(task: Prompt) -> None:
            return None

    assert app.handlers["summarise"].func is first


def test_a_plain_def_is_registered_to_run_in_a_thread_and_an_async_def_on_the_loop() -> None:
    app = _app()

    @app.handler("summarise")
    def summarise(task: Prompt, ctx: Context) -> str:
        return task.text

    @app.handler("translate")
    async def translate(task: Prompt) -> str:
        return task.text

    sync, not_sync = app.handlers["summarise"], app.handlers["translate"]
    assert (sync.is_sync, sync.takes_context, sync.model) == (True, True, Prompt)
    assert (not_sync.is_sync, not_sync.takes_context) == (False, False)


def test_a_generator_or_a_callable_object_is_refused() -> None:
    app = _app()

    def words(task: Prompt) -> Any:
        yield task.text

    async def chunks(task: Prompt) -> Any:
        yield task.text

    class Callable:
        def __call__(self, task: Prompt) -> str:
            return task.text

    for func, why in ((words, "generator"), (chunks, "generator"), (Callable(), "plain 'def'")):
        with pytest.raises(ConfigurationError, match=why):
            app.handler("summarise")(func)
    assert "summarise" not in app.handlers


@pytest.mark.parametrize("arity", [0, 3])
def test_handler_taking_neither_task_nor_task_and_ctx_is_refused(arity: int) -> None:
    app = _app()

    async def none() -> None:
        return None

    async def three(task: Prompt, ctx: Context, extra: int) -> None:
        return None

    func = none if arity == 0 else three
    with pytest.raises(ConfigurationError, match=f"got {arity} parameters"):
        app.handler("summarise")(func)


def test_keyword_only_parameters_do_not_count_as_task_or_ctx() -> None:
    app = _app()

    async def summarise(task: Prompt, *, verbose: bool = False) -> None:
        return None

    app.handler("summarise")(summarise)
    assert app.handlers["summarise"].takes_context is False


@pytest.mark.parametrize("queue", ["", "amq.summarise", "has space", "summarise.dlq", "q.retry.1s"])
def test_bad_queue_name_is_refused_at_decoration(queue: str) -> None:
    app = _app()
    with pytest.raises(ConfigurationError):

        @app.handler(queue)
        async def summarise(task: Prompt) -> None:
            return None

    assert queue not in app.handlers


@pytest.mark.parametrize(
    ("option", "fragment"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"delivery_limit": 0}, "delivery_limit"),
        ({"max_length": 0}, "max_length"),
    ],
)
def test_options_that_cannot_work_are_refused(option: dict[str, Any], fragment: str) -> None:
    app = _app()
    with pytest.raises(ConfigurationError, match=fragment):

        @app.handler("summarise", **option)
        async def summarise(task: Prompt) -> None:
            return None


def _prompt_spec() -> Any:
    app = _app()

    @app.handler("summarise")
    async def summarise(task: Prompt) -> None:
        return None

    return app.handlers["summarise"]


def test_parse_returns_the_validated_model() -> None:
    task = _prompt_spec().parse(b'{"text": "hello", "max_tokens": 8}')
    assert task == Prompt(text="hello", max_tokens=8)


@pytest.mark.parametrize(
    "body",
    [
        b"\xff{not json",  # bad UTF-8 and bad JSON
        b'{"text": "caf\xe9"}',  # Latin-1 byte inside otherwise valid JSON
        b'{"text": "hello"',  # truncated JSON
        b"",
        b"not json at all",
    ],
)
def test_body_that_is_not_utf8_json_is_undecodable(body: bytes) -> None:
    with pytest.raises(UndecodableBody):
        _prompt_spec().parse(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"max_tokens": 8}',  # missing field
        b'{"text": "hi", "max_tokens": "many"}',  # wrong type
        b'["text", "hi"]',  # JSON, wrong shape
        b"null",
    ],
)
def test_json_that_fails_the_model_is_invalid_not_undecodable(body: bytes) -> None:
    with pytest.raises(InvalidPayload) as info:
        _prompt_spec().parse(body)
    assert not isinstance(info.value, UndecodableBody)


def test_invalid_payload_message_names_the_field() -> None:
    with pytest.raises(InvalidPayload, match="text"):
        _prompt_spec().parse(b'{"max_tokens": 8}')


def test_unannotated_task_accepts_any_json() -> None:
    app = _app()

    @app.handler("summarise")
    async def summarise(task) -> None:  # type: ignore[no-untyped-def]
        return None

    assert app.handlers["summarise"].parse(b'[1, {"a": null}]') == [1, {"a": None}]
    with pytest.raises(UndecodableBody):
        app.handlers["summarise"].parse(b"{")


def test_redact_url_hides_the_password() -> None:
    redacted = redact_url("amqp://worker:s3cr3t-pw@rabbit.internal:5672/prod")
    assert "s3cr3t-pw" not in redacted
    assert redacted == "amqp://worker:***@rabbit.internal:5672/prod"


def test_redact_url_hides_a_password_without_a_port() -> None:
    redacted = redact_url("redis://:hunter2@cache/0")
    assert "hunter2" not in redacted
    assert redacted == "redis://:***@cache/0"


def test_redact_url_leaves_a_url_without_password_alone() -> None:
    assert redact_url("amqp://rabbit:5672/") == "amqp://rabbit:5672/"


def test_settings_never_show_the_url_password() -> None:
    settings = Settings(amqp_url=SecretStr("amqp://worker:s3cr3t-pw@rabbit:5672/"))
    assert "s3cr3t-pw" not in repr(settings)
    assert "s3cr3t-pw" not in str(settings.model_dump())
    assert settings.amqp_url_plain() == "amqp://worker:s3cr3t-pw@rabbit:5672/"


class _Strict(BaseModel):
    text: str

    @field_validator("text")
    @classmethod
    def _known(cls, value: str) -> str:
        return {"ok": "fine"}[value]  # KeyError for anything else: pydantic does not wrap it


def test_a_validator_raising_a_key_error_is_an_invalid_payload() -> None:
    app = _app()

    @app.handler("strict")
    async def strict(task: _Strict) -> None:
        return None

    spec = app.handlers["strict"]
    assert spec.parse(b'{"text": "ok"}').text == "fine"
    with pytest.raises(InvalidPayload, match="KeyError"):
        spec.parse(b'{"text": "unknown"}')


def test_publishing_a_payload_whose_validator_raises_a_key_error_is_a_validation_error() -> None:
    app = _app()

    @app.handler("strict")
    async def strict(task: _Strict) -> None:
        return None

    # prepare() is publish's check before anything is sent: no broker needed to see it refuse
    with pytest.raises(PayloadValidationError, match="KeyError"):
        app.prepare("strict", {"text": "unknown"})


def test_a_celery_style_handler_is_refused_with_what_to_write_instead() -> None:
    app = _app()

    def add(x, y):  # type: ignore[no-untyped-def]
        return x + y

    with pytest.raises(ConfigurationError) as raised:
        app.handler("add")(add)
    message = str(raised.value)
    assert "a handler takes one payload argument and an optional `ctx: Context`" in message
    assert "put `x` and `y` in a pydantic model" in message
    assert "add" not in app.handlers


def test_a_second_parameter_annotated_as_anything_but_the_context_is_refused() -> None:
    app = _app()

    async def add(x: int, y: int) -> int:
        return x + y

    with pytest.raises(ConfigurationError, match="put `x` and `y` in a pydantic model"):
        app.handler("add")(add)


@pytest.mark.parametrize("shape", ["varargs", "required_keyword"])
def test_a_handler_the_worker_cannot_call_is_refused(shape: str) -> None:
    app = _app()

    async def varargs(*values: int) -> None:
        return None

    async def required_keyword(task: Prompt, *, lang: str) -> None:
        return None

    func = varargs if shape == "varargs" else required_keyword
    with pytest.raises(ConfigurationError, match="a handler takes one payload argument"):
        app.handler("summarise")(func)


def test_the_context_is_recognised_by_its_type_or_by_its_name() -> None:
    app = _app()

    async def typed(task: Prompt, context: Context) -> None:
        return None

    def named(task, ctx):  # type: ignore[no-untyped-def]
        return None

    async def anything(task: Prompt, c: Any) -> None:
        return None

    for queue, func in (("typed", typed), ("named", named), ("anything", anything)):
        app.handler(queue)(func)
        assert app.handlers[queue].takes_context is True
