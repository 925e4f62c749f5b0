"""OpenAI request bodies → GenerateInput: OpenAI's defaults, kvfleet's extras, and a 400
naming the field for anything unsupported or malformed."""

from __future__ import annotations

import pytest

from kvfleet.errors import InvalidArgument
from kvfleet.router.openai_request import openai_param, parse_chat, parse_completion

HI = [{"role": "user", "content": "hi"}]


def field_of(parse, body) -> str:
    with pytest.raises(InvalidArgument) as err:
        parse(body)
    return err.value.field


def test_chat_follows_openai_defaults_and_fills_the_context():
    req = parse_chat({"model": "m", "messages": HI})
    (inp,) = req.inputs
    assert req.chat and not req.stream and req.logprobs is None and req.n == 1
    assert inp.sampling.temperature == 1.0 and inp.sampling.top_p == 1.0
    assert inp.fill_context  # max_tokens = the rest of the context, decided after routing
    assert inp.prompt.kind == "messages" and inp.prompt.messages == HI and inp.model == "m"


def test_completions_default_to_16_tokens_and_map_every_sampling_field():
    req = parse_completion({"prompt": "hi", "temperature": 0, "top_p": 0.5, "n": 2, "seed": 9,
                            "stop": "x", "presence_penalty": 1, "frequency_penalty": -1,
                            "top_k": 4, "repetition_penalty": 1.1, "ignore_eos": True,
                            "stop_token_ids": [3], "cache_salt": "s", "logprobs": 2,
                            "user": "u-1"})
    (inp,) = req.inputs
    p = inp.sampling
    assert not inp.fill_context and p.max_tokens == 16
    assert (p.temperature, p.top_p, p.n, p.seed, p.stop, p.top_k) == (0.0, 0.5, 2, 9, ("x",), 4)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, -1.0, 1.1)
    assert p.ignore_eos and p.stop_token_ids == (3,) and p.logprobs == 2
    assert inp.cache_salt == "s" and req.user == "u-1" and req.logprobs == 2


def test_chat_max_tokens_names_and_logprobs():
    assert parse_chat({"messages": HI, "max_completion_tokens": 7}).inputs[0].sampling.max_tokens == 7
    assert field_of(parse_chat, {"messages": HI, "max_tokens": 1,
                                 "max_completion_tokens": 2}) == "max_completion_tokens"
    assert parse_chat({"messages": HI, "logprobs": True}).logprobs == 0
    assert parse_chat({"messages": HI, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert field_of(parse_chat, {"messages": HI, "top_logprobs": 3}) == "top_logprobs"
    # SamplingParams' own bound, reported under the request's name for it
    assert field_of(parse_chat, {"messages": HI, "logprobs": True, "top_logprobs": 21}) == "top_logprobs"
    req = parse_chat({"messages": HI, "max_completion_tokens": 7})
    assert req.param("sampling.max_tokens") == "max_completion_tokens"


def test_content_parts_are_joined_and_developer_is_system():
    req = parse_chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert req.inputs[0].prompt.messages == [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "a\nb"},
                                             {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "function"}]}, "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": True}, "n"),
    ({"seed": -1}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"other": 1}}, "stream_options.other"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ({"top_p": 0}, "sampling.top_p"),
])
def test_chat_rejects_with_the_field_named(body, field):
    assert field_of(parse_chat, {"messages": HI, **body}) == field


def test_unsupported_fields_at_their_off_value_are_accepted():
    req = parse_chat({"messages": HI, "tools": [], "logit_bias": {}, "parallel_tool_calls": False,
                      "response_format": None, "stream": False})
    assert len(req.inputs) == 1


@pytest.mark.parametrize("prompt, kinds", [
    ("a", ["text"]), (["a", "b"], ["text", "text"]), ([1, 2], ["token_ids"]),
    ([[1], [2, 3]], ["token_ids", "token_ids"]),
])
def test_completion_prompt_shapes(prompt, kinds):
    assert [i.prompt.kind for i in parse_completion({"prompt": prompt}).inputs] == kinds


@pytest.mark.parametrize("body, field", [
    ({"prompt": []}, "prompt"), ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
])
def test_completions_reject_with_the_field_named(body, field):
    assert field_of(parse_completion, body) == field


def test_kvfleet_fields_map_to_openai_params():
    assert openai_param("sampling.top_p") == "top_p"
    assert openai_param("text") == openai_param("token_ids") == "prompt"
    assert openai_param("messages[2].role") == "messages[2].role" and openai_param(None) is None


def test_continuous_usage_stats_is_taken_with_include_usage_as_vllm_does():
    def options(**o):
        req = parse_completion({"prompt": "x", "stream": True, "stream_options": o})
        return req.include_usage, req.continuous_usage
    assert options(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert options(continuous_usage_stats=True) == (False, False)  # no usage: none per chunk
    assert options(include_usage=True, continuous_usage_stats=False) == (True, False)
    chat = parse_chat({"messages": HI, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert chat.continuous_usage
