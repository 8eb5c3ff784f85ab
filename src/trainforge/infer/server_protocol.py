"""The request bodies of ``trainforge serve`` as pydantic models, the way vLLM's
``entrypoints/openai/protocol.py`` declares them: FastAPI validates each body against its
model before the handler runs, and ``/openapi.json`` (and the ``/docs`` page) list every
field with its type and bounds.

Validation is strict (``ConfigDict(strict=True)``): ``"n": "2"``, ``"n": 2.0`` and
``"n": true`` are refused, as the hand-written checks this replaces refused them, rather
than coerced. ``null`` is the same as leaving a field out. Fields this server does not know
are ignored (OpenAI clients send ``user``, ``logit_bias`` ...). A refused value is a
``PydanticCustomError`` whose message says what the field wants (``must be a number in
[0, 2], got -1``); ``server_body.validation_error`` turns the first one into OpenAI's 400
naming the field. Bounds that depend on the server (``n`` up to max_batch_size + max_queue,
token ids below the vocabulary size) are checked by the handlers.

Extensions beyond OpenAI are spelled as vLLM spells them: ``top_k``, ``repetition_penalty``,
``ignore_eos``, ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WrapValidator, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from trainforge.infer.openai_schema import APIError
from trainforge.infer.sampling import SamplingParams

# A rejected value in an error message: a few items and characters, never a 1 MiB list.
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxlong = 2, 4, 4, 40, 40

INT64 = (-(1 << 63), (1 << 63) - 1)  # OpenAI's and vLLM's seed: a 64-bit signed integer
TOP = SamplingParams.MAX_LOGPROBS  # 20, as vLLM (OpenAI's legacy API stops at 5)
INVALID = "invalid_field"  # the error type of a refused value (message: "must be ..., got ...")
RULE = "field_rule"  # a rule between fields or an unsupported option (ctx "param" names the field)


def invalid(want: str, value: Any) -> PydanticCustomError:
    """A refused value: "must be ``want``, got ``value``" (shortened)."""
    return PydanticCustomError(INVALID, "must be {want}, got {got}", {"want": want, "got": _short.repr(value)})


def checked(type_: Any, want: str, **constraints: Any) -> Any:
    """``type_`` with pydantic ``constraints``; any failure is one error "must be ``want``,
    got ``value``" (not pydantic's one error per member of a union)."""
    def wrap(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise invalid(want, value) from None
    return Annotated[type_, Field(**constraints), WrapValidator(wrap)]


def rule(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(RULE, message, {"param": param})


@dataclass(frozen=True)
class Choices:
    """How many completions a request wants and how they are streamed."""

    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage, empty choices
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs tokens as "token_id:ID"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: checked(bool, "a boolean") | None = Field(
        None, description="a last chunk with the usage and no choices (the others carry usage: null)")


def _an_object(value: Any) -> Any:
    """Before a nested object's fields are validated: a clear error if it is no object (then
    its fields' own errors name them: ``stream_options.include_usage``)."""
    if not isinstance(value, dict):
        raise invalid("an object", value)
    return value


class _Sampling(_Body):
    """The fields completions and chat share: sampling, stopping and how choices are returned."""

    max_tokens: checked(int, "an integer >= 1", ge=1) | None = Field(
        None, description="most tokens to generate (prompt + max_tokens must fit the context); default 16 for "
                          "completions, for chat what fits (at most 256)")
    max_completion_tokens: checked(int, "an integer >= 1", ge=1) | None = Field(
        None, description="OpenAI's newer name for max_tokens (wins over it)")
    temperature: checked(float, "a number in [0, 2]", ge=0, le=2) | None = Field(
        None, description="0 is greedy; default 1")
    top_p: checked(float, "a number in (0, 1]", gt=0, le=1) | None = Field(
        None, description="nucleus sampling; default 1")
    top_k: checked(int, "an integer >= 0", ge=0) | None = Field(
        None, description="sample among the k likeliest tokens; 0 (default) = all")
    repetition_penalty: checked(float, "a finite number > 0", gt=0,
                                allow_inf_nan=False) | None = Field(None, description="default 1 (none)")
    stop: checked(str | list[str], "a non-empty string or a list of at most 4",
                  ) | None = Field(None, description="up to 4 strings that end the text (not included)")
    ignore_eos: checked(bool, "a boolean") | None = Field(
        None, description="keep generating past the end-of-text token")
    seed: checked(int, f"an integer in [{INT64[0]}, {INT64[1]}]", ge=INT64[0],
                  le=INT64[1]) | None = Field(None, description="choice i samples with seed + i")
    presence_penalty: checked(float, "a number") | None = Field(
        None, description="not supported: only 0 (use repetition_penalty)")
    frequency_penalty: checked(float, "a number") | None = Field(
        None, description="not supported: only 0 (use repetition_penalty)")
    n: checked(int, "an integer >= 1", ge=1) | None = Field(
        None, description="choices, each its own sequence; at most the server's max_batch_size + max_queue")
    stream: checked(bool, "a boolean") | None = Field(None, description="server-sent events ending data: [DONE]")
    stream_options: Annotated[StreamOptions, BeforeValidator(_an_object)] | None = Field(
        None, description="only with stream: true")
    return_tokens_as_token_ids: checked(bool, "a boolean") | None = Field(
        None, description="logprobs tokens as 'token_id:ID'")
    model: str | None = Field(None, description="the served model's id (any other is a 404)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        if isinstance(stop, list) and (len(stop) > 4 or not all(stop)) or stop == "":
            raise invalid("a non-empty string or a list of at most 4", stop)
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        if v not in (None, 0):
            raise rule(info.field_name, f"'{info.field_name}' is not supported (use 'repetition_penalty')")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise rule("stream_options", "'stream_options' is only allowed when 'stream' is true")
        return self

    def logprobs_k(self) -> int | None:
        """The number of top log-probabilities per token, or None for no logprobs."""
        raise NotImplementedError

    def choices(self, max_n: int) -> Choices:
        """``n`` (each choice is its own engine request, so at most ``max_n``, the engine's
        running + waiting bound: a 400 naming ``n`` beyond it), ``stream``, ``stream_options``."""
        n = 1 if self.n is None else self.n
        if n > max_n:
            raise APIError(400, f"'n' must be an integer in [1, {max_n}] (the server's max_batch_size + max_queue), "
                           f"got {n}", param="n")
        usage = bool(self.stream_options and self.stream_options.include_usage)
        return Choices(n=n, stream=bool(self.stream), include_usage=usage,
                       tokens_as_ids=bool(self.return_tokens_as_token_ids))

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            stop=tuple(stop or ()),
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            logprobs=self.logprobs_k(),
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: checked(str | list[int] | list[str] | list[list[int]],
                    "a string, a list of token ids, or a one-element list of either") = Field(
        description="text, or token ids; a one-element list of either (batches of prompts are not supported)")
    logprobs: checked(int, f"an integer in [0, {TOP}]", ge=0, le=TOP) | None = Field(
        None, description="top log-probabilities per token (the model's raw log-softmax)")
    echo: checked(bool, "a boolean") | None = Field(None, description="not supported: only false")
    best_of: checked(int, "an integer") | None = Field(None, description="not supported: only 1 or n")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) or prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise invalid("a string, a list of token ids, or a one-element list of either", prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo):
        if echo:
            raise rule("echo", "'echo' is not supported by this server")
        return echo

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of not in (None, 1, self.n or 1):
            raise rule("best_of", "'best_of' is not supported by this server")
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs


class ContentPart(_Body):
    """One part of a message's content; only text parts are kept (others, e.g. images, are ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a string 'text'")
        return self


class ChatMessage(_Body):
    role: str
    content: checked(str | list[ContentPart], "a string or a list of content parts")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


def _non_empty(messages: Any) -> Any:
    """Before the items are validated: a clear error for a missing or empty list (then each
    message's own errors name it: ``messages[1].role``)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("a non-empty list of messages", messages)
    return messages


Messages = Annotated[list[ChatMessage], BeforeValidator(_non_empty)]


def chat_prompt(messages: list[ChatMessage]) -> str:
    """OpenAI chat messages -> one prompt string (``role: content`` lines, then ``assistant:``):
    trainforge models are not chat-tuned and no Jinja chat template is read."""
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Messages = Field(description="rendered as 'role: content' lines, then 'assistant:'")
    logprobs: checked(bool, "a boolean") | None = Field(None, description="log-probability of each token")
    top_logprobs: checked(int, f"an integer in [0, {TOP}]", ge=0, le=TOP) | None = Field(
        None, description="top log-probabilities per token; needs logprobs: true")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise rule("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages`` (which win)."""

    prompt: checked(str, "a string") | None = None
    messages: Messages | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one_of(self):
        if self.messages is None and self.prompt is None:
            raise rule("prompt", "give 'prompt' (a string) or 'messages' (a chat)")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    tokens: checked(list[int], "a list of token ids")
    model: str | None = None
