"""OpenAI request bodies → :class:`~kvfleet.router.core.GenerateInput` (chat and completions).

OpenAI's defaults apply, not gRPC's: ``temperature`` 1, completions ``max_tokens`` 16, chat
bounded only by the context. kvfleet extras keep their own names as vLLM's do (``top_k``,
``repetition_penalty``, ``cache_salt``, ``ignore_eos``, ``stop_token_ids``, ``guided_*``,
``priority``: a class name or an integer, :mod:`kvfleet.priority`; ``speculative``: false opts
the request out of the replica's speculative decoding).
Structured output and tools: :mod:`kvfleet.router.openai_structured`. A field kvfleet
does not support (``echo``, ``logit_bias``, …, or any unknown name) is an
:class:`~kvfleet.errors.InvalidArgument` naming it unless it holds its "off" value (null,
false, empty): never silently ignored. ``user`` is recorded on the trace only.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from kvfleet import priority
from kvfleet.constraint import Constraint
from kvfleet.errors import InvalidArgument
from kvfleet.router.core import GenerateInput, Prompt
from kvfleet.router.openai_structured import (
    STRUCTURED_FIELDS,
    TOOL_FIELDS,
    parse_constraint,
    parse_tools,
)
from kvfleet.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_PROMPTS = 64  # prompts in one completions array

_COMMON = {"model", "stream", "stream_options", "n", "stop", "seed", "temperature", "top_p",
           "presence_penalty", "frequency_penalty", "max_tokens", "user",
           "top_k", "repetition_penalty", "cache_salt", "ignore_eos", "stop_token_ids",
           "priority", "speculative"}
CHAT_FIELDS = _COMMON | STRUCTURED_FIELDS | TOOL_FIELDS | {"messages", "max_completion_tokens",
                                                          "logprobs", "top_logprobs"}
COMPLETION_FIELDS = _COMMON | STRUCTURED_FIELDS | {"prompt", "logprobs"}
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated chat or completions request: one :class:`GenerateInput` per prompt (chat:
    exactly one), and what shapes the response."""

    chat: bool
    inputs: tuple[GenerateInput, ...]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]  # top-N per token; None = no logprobs in the response
    n: int
    user: str
    # kvfleet field → this request's parameter, where not the generic one (see openai_param)
    aliases: tuple[tuple[str, str], ...] = ()
    # Structured output: the constraint (the worker's compile errors name its field) and the
    # tools a response may call (tool_choice auto / required / named), else ().
    constraint: Optional[Constraint] = None
    tools: tuple[str, ...] = ()
    # stream_options.continuous_usage_stats (vLLM's): with include_usage, every chunk carries
    # the usage so far, not only the last one.
    continuous_usage: bool = False

    def param(self, field: Optional[str]) -> Optional[str]:
        """The request parameter an error about kvfleet ``field`` names."""
        alias = dict(self.aliases).get(field) if field is not None else None
        return alias or openai_param(field)


def openai_param(field: Optional[str]) -> Optional[str]:
    """OpenAI's name for a kvfleet request field (``sampling.top_p`` → ``top_p``, the prompt's
    ``text`` / ``token_ids`` → ``prompt``)."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    return "prompt" if field in ("text", "token_ids") else field


def _type(body: dict, name: str, kinds, what: str, prefix: str = ""):
    """``body[name]`` (None when absent or null), checked to be of ``kinds``. Raises
    InvalidArgument naming ``prefix + name``."""
    value = body.get(name)
    if value is None:
        return None
    field = prefix + name
    # bool is an int in Python: a JSON true is not a number here.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidArgument(f"{field} must be {what}, got {value!r}", field=field)
    if not isinstance(value, kinds):
        raise InvalidArgument(f"{field} must be {what}, got {type(value).__name__}", field=field)
    return value


def _reject_unsupported(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name not in allowed and value not in (None, False, [], {}, ""):
            raise InvalidArgument(f"{name} is not supported by kvfleet", field=name)


def _sampling(body: dict, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
    """SamplingParams with OpenAI's defaults; bounds are SamplingParams' own (same messages)."""
    kw: dict[str, Any] = {"temperature": 1.0, "logprobs": logprobs}
    for name, kinds, what in (("temperature", (int, float), "a number"),
                              ("top_p", (int, float), "a number"),
                              ("presence_penalty", (int, float), "a number"),
                              ("frequency_penalty", (int, float), "a number"),
                              ("repetition_penalty", (int, float), "a number"),
                              ("top_k", int, "an integer"), ("n", int, "an integer"),
                              ("ignore_eos", bool, "a boolean"),
                              ("speculative", bool, "a boolean")):
        value = _type(body, name, kinds, what)
        if value is not None:
            kw[name] = float(value) if kinds == (int, float) else value
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    seed = _type(body, "seed", int, "an integer")
    if seed is not None and seed < 0:
        raise InvalidArgument(f"seed must be >= 0, got {seed}", field="seed")
    kw["seed"] = secrets.randbits(63) if seed is None else seed % (1 << 64)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidArgument("stop must be a string or an array of strings", field="stop")
    kw["stop"] = tuple(stop or ())
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and _all_ints(ids)):
        raise InvalidArgument("stop_token_ids must be an array of integers", field="stop_token_ids")
    kw["stop_token_ids"] = tuple(ids or ())
    return SamplingParams(**kw).validate()


def _all_ints(values: list) -> bool:
    """Every item is a JSON integer (a bool's type is bool, not int). In C: a prompt can hold
    thousands of ids, and a generator over them showed in the request's cost (docs/design.md §10)."""
    return set(map(type, values)) <= {int}


def _base(body: dict, allowed: set[str]) -> dict:
    """Checks shared by both endpoints; returns the fields every GenerateInput carries."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    _reject_unsupported(body, allowed)
    stream = _type(body, "stream", bool, "a boolean") or False
    options = _type(body, "stream_options", dict, "an object") or {}
    if options and not stream:
        raise InvalidArgument("stream_options is only allowed with stream: true",
                              field="stream_options")
    _reject_unsupported({f"stream_options.{k}": v for k, v in options.items()},
                        {"stream_options.include_usage", "stream_options.continuous_usage_stats"})
    include_usage, continuous = (_type(options, k, bool, "a boolean", "stream_options.")
                                 for k in ("include_usage", "continuous_usage_stats"))
    return {"model": _type(body, "model", str, "a string") or "",
            "cache_salt": _type(body, "cache_salt", str, "a string") or "",
            "stream": stream, "include_usage": bool(include_usage),
            # as vLLM: usage in every chunk only when the last one carries it too
            "continuous_usage": bool(include_usage and continuous),
            "user": _type(body, "user", str, "a string") or "",
            # None (absent or null): the API key's default, else "default".
            "priority": None if body.get("priority") is None else priority.parse(body["priority"])}


def _message(i: int, m) -> dict:
    if not isinstance(m, dict):
        raise InvalidArgument(f"messages[{i}] must be an object", field=f"messages[{i}]")
    _reject_unsupported({f"messages[{i}].{k}": v for k, v in m.items()},
                        {f"messages[{i}].{k}" for k in ("role", "content", "tool_calls",
                                                        "tool_call_id", "name")})
    role = m.get("role")
    if not isinstance(role, str):
        raise InvalidArgument(f"messages[{i}].role must be a string", field=f"messages[{i}].role")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: text only, joined as vLLM joins them
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{where}.type must be 'text' with a string 'text' "
                                      f"(kvfleet serves text only), got {kind!r}",
                                      field=f"{where}.type")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise InvalidArgument(f"messages[{i}].content must be a string or an array of "
                              f"content parts", field=f"messages[{i}].content")
    if m.get("tool_calls"):  # an earlier call, shown to the model as it was asked to write one
        content = "\n".join([content, *(_call_text(i, c) for c in m["tool_calls"])]).strip()
    return {"role": _ROLES.get(role, role), "content": content}


def _call_text(i: int, call) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    try:
        if fn is None:
            raise TypeError("no function")
        return json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
    except (TypeError, KeyError, ValueError):
        raise InvalidArgument(f"messages[{i}].tool_calls: each needs function.name and "
                              "function.arguments (JSON text)",
                              field=f"messages[{i}].tool_calls") from None


def parse_chat(body: dict) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body. Raises InvalidArgument naming the field."""
    base = _base(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty array", field="messages")
    msgs = [_message(i, m) for i, m in enumerate(messages)]
    constraint, plan = parse_constraint(body), parse_tools(body)
    if constraint is not None and plan.constraint is not None:
        raise InvalidArgument(f"tool_choice {plan.mode} constrains the output: it cannot be "
                              f"combined with {constraint.field}", field="tool_choice")
    constraint = constraint or plan.constraint
    if plan.system:  # the tools, described in the system message (SmolLM2 has no tool format)
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + plan.system}
        else:
            msgs.insert(0, {"role": "system", "content": plan.system})
    max_tokens = _type(body, "max_tokens", int, "an integer")
    max_completion = _type(body, "max_completion_tokens", int, "an integer")
    if max_tokens is not None and max_completion is not None:
        raise InvalidArgument("max_tokens and max_completion_tokens: set one of them",
                              field="max_completion_tokens")
    if max_completion is not None:
        max_tokens = max_completion
    want = _type(body, "logprobs", bool, "a boolean")
    top = _type(body, "top_logprobs", int, "an integer")
    if top is not None and not want:
        raise InvalidArgument("top_logprobs requires logprobs: true", field="top_logprobs")
    logprobs = (top or 0) if want else None
    aliases = (("sampling.logprobs", "top_logprobs"),
               ("sampling.max_tokens", "max_tokens" if max_completion is None
                else "max_completion_tokens"))
    try:
        params = _sampling(body, max_tokens, logprobs)
    except InvalidArgument as exc:
        if exc.field is not None:
            exc.field = dict(aliases).get(exc.field, exc.field)
        raise
    req = GenerateInput(Prompt("messages", messages=msgs), params, model=base["model"],
                        cache_salt=base["cache_salt"], fill_context=max_tokens is None,
                        constraint=constraint, priority=base["priority"])
    return OpenAIRequest(True, (req,), base["stream"], base["include_usage"], logprobs,
                         params.n, base["user"], aliases, constraint, plan.names,
                         continuous_usage=base["continuous_usage"])


def _prompts(prompt) -> list[Prompt]:
    """OpenAI's four prompt shapes: a string, strings, token ids, arrays of token ids."""
    if isinstance(prompt, str):
        return [Prompt("text", text=prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [Prompt("text", text=p) for p in prompt]
        if _all_ints(prompt):
            return [Prompt("token_ids", token_ids=prompt)]
        if all(isinstance(p, list) and p and _all_ints(p) for p in prompt):
            return [Prompt("token_ids", token_ids=p) for p in prompt]
    raise InvalidArgument("prompt must be a string, an array of strings, an array of token ids "
                          "or an array of arrays of token ids, and not empty", field="prompt")


def parse_completion(body: dict) -> OpenAIRequest:
    """A ``POST /v1/completions`` body. Raises InvalidArgument naming the field."""
    base = _base(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt: at most {MAX_PROMPTS} prompts, got {len(prompts)}",
                              field="prompt")
    max_tokens = _type(body, "max_tokens", int, "an integer")
    logprobs = _type(body, "logprobs", int, "an integer")
    params = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                       logprobs)
    constraint = parse_constraint(body)
    inputs = tuple(GenerateInput(p, params, model=base["model"], cache_salt=base["cache_salt"],
                                 constraint=constraint, priority=base["priority"])
                   for p in prompts)
    return OpenAIRequest(False, inputs, base["stream"], base["include_usage"], logprobs,
                         params.n, base["user"], constraint=constraint,
                         continuous_usage=base["continuous_usage"])
