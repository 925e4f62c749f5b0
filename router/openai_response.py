"""kvfleet's stream messages → OpenAI response bodies, stream chunks and error bodies.

One :class:`ResponseBuilder` per HTTP request shapes both the non-streaming body (messages
folded per choice) and each SSE chunk (``chat.completion.chunk`` / ``text_completion``). Choice
``i`` of prompt ``p`` is index ``p × n + i``. ``usage.prompt_tokens_details.cached_tokens`` is
what the workers reused from their prefix caches.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc

from kvfleet.errors import PromptTooLarge
from kvfleet.router.openai_structured import parse_tool_call
from kvfleet.v1 import common_pb2

FINISH = {common_pb2.STOP: "stop", common_pb2.LENGTH: "length"}

# gRPC status → (HTTP status, OpenAI error type)
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),  # e.g. chat, no template
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_S = 1  # the Retry-After of a 429: a queue full now may have room in a second


def error_response(code: grpc.StatusCode, message: str, param: Optional[str],
                   exc: Optional[BaseException] = None) -> tuple[int, dict, dict]:
    """``(HTTP status, OpenAI error body, extra headers)`` for a gRPC status and message.

    ``error.code`` is the gRPC status name in lower case (``invalid_argument``, …), so the
    two edges' errors can be matched one to one.
    """
    status, kind = _HTTP.get(code, (500, "internal_server_error"))
    if isinstance(exc, PromptTooLarge):
        status = 413
    headers = {"retry-after": str(RETRY_AFTER_S)} if status == 429 else {}
    return status, {"error": {"message": message, "type": kind, "param": param,
                              "code": code.name.lower()}}, headers


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # shaped entries (chat) or token rows
    finish_reason: Optional[str] = None
    offset: int = 0  # completions text_offset: characters so far
    tokens: int = 0  # sampled so far (the worker's count replaces it at the finish)


class ResponseBuilder:
    """Shapes one request's response. ``token_text(id)`` decodes one token (logprobs)."""

    def __init__(self, chat: bool, request_id: str, model: str, n: int,
                 logprobs: Optional[int], token_text: Callable[[int], str],
                 tools: tuple[str, ...] = ()) -> None:
        # Chat with tools: a choice whose whole text is one call of these is returned as
        # ``tool_calls``; streamed, its text is held back until it has finished.
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.model, self.n, self.want_logprobs = model, n, logprobs is not None
        self.token_text = token_text
        self.tools = tools if chat else ()
        self.choices: dict[int, _Choice] = {}
        self._prompt: dict[int, tuple[int, int]] = {}  # prompt index → (tokens, cached)
        self._completion_tokens = 0

    # ---- per message -------------------------------------------------------------------
    def prompt_started(self, prompt: int, prompt_tokens: int) -> None:
        """Prompt ``prompt`` has ``prompt_tokens`` tokens (the router's count, known before its
        first message): the usage so far counts them (the worker's usage at its finish
        replaces it)."""
        self._prompt.setdefault(prompt, (prompt_tokens, 0))

    def index(self, prompt: int, msg: common_pb2.GenerateResponse) -> int:
        return prompt * self.n + msg.index

    def add(self, prompt: int, msg: common_pb2.GenerateResponse) -> tuple[int, Optional[dict]]:
        """Fold one message into its choice; returns ``(choice index, its logprobs piece)``."""
        i = self.index(prompt, msg)
        choice = self.choices.setdefault(i, _Choice())
        choice.text.append(msg.text)
        choice.tokens += len(msg.token_ids)
        piece = self._logprobs(choice, msg) if self.want_logprobs else None
        if msg.finish_reason:
            choice.finish_reason = FINISH.get(msg.finish_reason, "stop")
            self._prompt[prompt] = (msg.usage.prompt_tokens, msg.usage.cached_prompt_tokens)
            self._completion_tokens += msg.usage.completion_tokens
        return i, piece

    def _logprobs(self, choice: _Choice, msg) -> dict:
        if self.chat:
            rows = [{**self._token(lp.token_id, lp.logprob),
                     "top_logprobs": [self._token(t.token_id, t.logprob) for t in lp.top]}
                    for lp in msg.logprobs]
            choice.logprobs.extend(rows)
            return {"content": rows}
        piece: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in msg.logprobs:
            text = self.token_text(lp.token_id)
            piece["tokens"].append(text)
            piece["token_logprobs"].append(lp.logprob)
            piece["top_logprobs"].append({self.token_text(t.token_id): t.logprob for t in lp.top})
            piece["text_offset"].append(choice.offset)
            choice.offset += len(text)
        choice.logprobs.append(piece)
        return piece

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    # ---- streaming ---------------------------------------------------------------------
    def role_chunks(self, num_prompts: int) -> list[dict]:
        """Chat: the role-only chunk that opens each choice (none for completions)."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(num_prompts * self.n)]

    def chunk(self, prompt: int, msg: common_pb2.GenerateResponse, include_usage: bool,
              continuous_usage: bool = False) -> Optional[dict]:
        """The SSE chunk that carries one message (after :meth:`add` would fold it); None for
        a tool-mode choice that has not finished (its text is held back). With
        ``include_usage`` the chunk has a ``usage`` key: null, or with ``continuous_usage``
        the response's usage so far (vLLM's ``continuous_usage_stats``)."""
        i, piece = self.add(prompt, msg)
        finish = self.choices[i].finish_reason if msg.finish_reason else None
        if self.tools:
            return self._tool_chunk(i, piece, include_usage, continuous_usage) if finish else None
        if self.chat:
            choice = {"index": i, "delta": {"content": msg.text} if msg.text else {},
                      "logprobs": piece, "finish_reason": finish}
        else:
            choice = {"index": i, "text": msg.text, "logprobs": piece, "finish_reason": finish}
        return self._with_usage(self._chunk(choice), include_usage, continuous_usage)

    def _with_usage(self, out: dict, include_usage: bool, continuous_usage: bool) -> dict:
        if include_usage:  # OpenAI's: only the last chunk carries usage; vLLM's option: each
            out["usage"] = self.usage() if continuous_usage else None
        return out

    def _tool_chunk(self, i: int, piece: Optional[dict], include_usage: bool,
                    continuous_usage: bool) -> dict:
        """The one chunk of a finished tool-mode choice: its call, or its whole text."""
        c = self.choices[i]
        message = self._message(c)
        delta: dict = {"content": message["content"]} if message["content"] else {}
        if "tool_calls" in message:
            delta = {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        logprobs = self._folded_logprobs(c) if self.want_logprobs else None
        return self._with_usage(self._chunk({"index": i, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": c.finish_reason}),
                                include_usage, continuous_usage)

    def _message(self, c: _Choice) -> dict:
        """The chat ``message`` of a finished choice; a tool call sets ``finish_reason``."""
        text = "".join(c.text)
        call = parse_tool_call(text, self.tools) if self.tools else None
        if call is None:
            return {"role": "assistant", "content": text}
        if c.finish_reason == "stop":
            c.finish_reason = "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call[0], "arguments": call[1]}}]}

    def usage_chunk(self) -> dict:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: Optional[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [choice] if choice else []}

    # ---- whole response ----------------------------------------------------------------
    def usage(self) -> dict:
        """The response's usage: its whole once every choice has finished, else so far (the
        finished choices' counts, the others' tokens streamed; cached tokens are known at a
        prompt's first finish)."""
        prompt = sum(p for p, _ in self._prompt.values())
        cached = sum(c for _, c in self._prompt.values())
        completion = self._completion_tokens + sum(
            c.tokens for c in self.choices.values() if c.finish_reason is None)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def body(self) -> dict:
        """The non-streaming response, once every choice has finished."""
        choices = []
        for i in sorted(self.choices):
            c = self.choices[i]
            text = "".join(c.text)
            logprobs = self._folded_logprobs(c) if self.want_logprobs else None
            if self.chat:
                choices.append({"index": i, "message": self._message(c),
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    def _folded_logprobs(self, c: _Choice) -> dict:
        if self.chat:
            return {"content": c.logprobs}
        return {key: [v for piece in c.logprobs for v in piece[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
