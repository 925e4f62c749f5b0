"""gRPC statuses → OpenAI error bodies and HTTP statuses; messages → chunk and body shapes."""

from __future__ import annotations

import grpc
import pytest

from kvfleet.errors import InvalidArgument, PromptTooLarge
from kvfleet.router.openai_response import ResponseBuilder, error_response
from kvfleet.v1 import common_pb2

C = grpc.StatusCode


@pytest.mark.parametrize("code, status, kind", [
    (C.INVALID_ARGUMENT, 400, "invalid_request_error"), (C.OUT_OF_RANGE, 400, "invalid_request_error"),
    (C.FAILED_PRECONDITION, 400, "invalid_request_error"),
    (C.UNAUTHENTICATED, 401, "authentication_error"), (C.NOT_FOUND, 404, "not_found_error"),
    (C.ALREADY_EXISTS, 409, "conflict_error"), (C.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (C.UNAVAILABLE, 503, "service_unavailable_error"), (C.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (C.INTERNAL, 500, "internal_server_error"),
])
def test_status_mapping(code, status, kind):
    got, body, headers = error_response(code, "why", "p")
    assert got == status
    assert body == {"error": {"message": "why", "type": kind, "param": "p", "code": code.name.lower()}}
    assert headers == ({"retry-after": "1"} if status == 429 else {})


def test_a_prompt_over_the_byte_limit_is_a_413():
    exc = PromptTooLarge("text exceeds 1048576 bytes", field="text")
    assert error_response(C.INVALID_ARGUMENT, str(exc), "prompt", exc)[0] == 413
    plain = InvalidArgument("text must not be empty", field="text")
    assert error_response(C.INVALID_ARGUMENT, str(plain), "prompt", plain)[0] == 400


def msg(index: int, text: str, token: int, finish=0, completion=0) -> common_pb2.GenerateResponse:
    m = common_pb2.GenerateResponse(index=index, text=text, token_ids=[token], finish_reason=finish)
    m.logprobs.add(token_id=token, logprob=-0.5).top.add(token_id=token, logprob=-0.5)
    if finish:
        m.usage.prompt_tokens, m.usage.cached_prompt_tokens = 10, 8
        m.usage.completion_tokens = completion
    return m


def test_choices_of_prompts_and_samples_fold_into_one_body():
    b = ResponseBuilder(False, "r1", "m", n=2, logprobs=1, token_text=lambda t: f"<{t}>")
    for prompt in (0, 1):
        b.add(prompt, msg(0, "a", 5))
        b.add(prompt, msg(1, "c", 7, finish=common_pb2.LENGTH, completion=1))
        b.add(prompt, msg(0, "b", 6, finish=common_pb2.STOP, completion=2))
    body = b.body()
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "stop"), (1, "c", "length"), (2, "ab", "stop"), (3, "c", "length")]
    assert body["choices"][0]["logprobs"] == {"tokens": ["<5>", "<6>"], "token_logprobs": [-0.5, -0.5],
                                              "top_logprobs": [{"<5>": -0.5}, {"<6>": -0.5}],
                                              "text_offset": [0, 3]}
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                             "prompt_tokens_details": {"cached_tokens": 16}}


def test_chat_chunks_open_each_choice_then_carry_deltas():
    b = ResponseBuilder(True, "r2", "m", n=1, logprobs=None, token_text=str)
    (role,) = b.role_chunks(1)
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    first = b.chunk(0, msg(0, "Hi", 5), include_usage=True)
    assert first["choices"][0]["delta"] == {"content": "Hi"} and first["usage"] is None
    last = b.chunk(0, msg(0, "", 2, finish=common_pb2.STOP, completion=2), include_usage=True)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage = b.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    b = ResponseBuilder(False, "r3", "m", n=2, logprobs=None, token_text=str)
    b.prompt_started(0, 10)  # the router's count, before the first message
    first = b.chunk(0, msg(0, "a", 5), include_usage=True, continuous_usage=True)
    assert first["usage"] == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert b.chunk(0, msg(1, "b", 6), True, True)["usage"]["completion_tokens"] == 2
    done = b.chunk(0, msg(0, "", 7, finish=common_pb2.STOP, completion=3), True, True)
    assert done["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 8}}  # 3 + 1 streamed
    last = b.chunk(0, msg(1, "", 8, finish=common_pb2.LENGTH, completion=2), True, True)
    assert last["usage"]["completion_tokens"] == 5 == b.usage_chunk()["usage"]["completion_tokens"]
    assert b.chunk(0, msg(0, "a", 5), include_usage=True)["usage"] is None  # OpenAI's default
