"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one handler each, and the
``Generation`` they share (submit ``n`` engine requests, then answer with one JSON body or a
server-sent-event stream).

Each handler: refuse at once if the server is full (``server_body``, before the body is
read: a slow client holds no place); FastAPI validates the body against its model (a 400
whatever the load); then admit (``Admission.hold``), tokenise off the loop, submit.

The engine steps in its own thread; a handler only submits requests and awaits the tokens
it hands back (``Request.on_update`` -> ``loop.call_soon_threadsafe``), so the event loop
stays free. A client that disconnects (mid-stream, or while waiting for a non-streamed
answer) has its requests aborted; the engine frees their rows and KV blocks at its next
step. The non-streamed wait watches the connection by awaiting the ASGI
``http.disconnect`` message (no polling); streamed responses get it from Starlette's
disconnect listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Callable

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.requests import Request as HTTPRequest  # at module level: FastAPI resolves annotations here

from trainforge.infer.engine import QueueFull, RequestTooLong
from trainforge.infer.openai_schema import APIError, TextOffsets, chat_logprobs, completion_logprobs
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.server_body import body_route
from trainforge.infer.server_protocol import ChatCompletionRequest, Choices, CompletionRequest, chat_prompt
from trainforge.infer.server_state import ServerState, state_of

router = APIRouter(route_class=body_route(lambda state: state.admission.check), tags=["generation"])


@router.post("/v1/completions", summary="Text completion (OpenAI's legacy completions)")
async def completions(body: CompletionRequest, request: HTTPRequest):
    state = state_of(request)
    choices = body.choices(state.engine_cap)
    params = body.sampling_params(state.config.default_max_tokens)
    prompt = state.check_text(body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
    with state.admission.hold() as admitted:
        ids = await state.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        return await Generation(state, request, ids, params, choices, chat=False).answer(admitted)


@router.post("/v1/chat/completions", summary="Chat completion (messages rendered as 'role: content' lines)")
async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
    state = state_of(request)
    choices = body.choices(state.engine_cap)
    text = state.check_text(chat_prompt(body.messages), "messages")
    with state.admission.hold() as admitted:
        ids = await state.encode(text, "messages")
        default = max(1, min(256, state.engine.max_context - len(ids)))  # what fits, as vLLM's default
        params = body.sampling_params(default)
        return await Generation(state, request, ids, params, choices, chat=True).answer(admitted)


class Generation:
    """One completion request: ``choices.n`` engine requests (one per choice; seed, seed + 1,
    ... when a seed is given, else a fresh one each) and the response that reports them, a
    JSON body or an SSE stream whose chunks carry each choice's ``index``."""

    def __init__(self, state: ServerState, request: HTTPRequest, ids: list[int], params: SamplingParams,
                 choices: Choices, chat: bool):
        self.state, self.request, self.ids, self.params, self.choices, self.chat = (
            state, request, ids, params, choices, chat)
        self.want_lp = params.logprobs is not None
        self.token_text = state.token_texts[choices.tokens_as_ids]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()  # streamed: (index, new ids, logprobs, text, finished)
        self.finished = asyncio.Event()  # not streamed: set once, when every choice has ended
        self.ended = 0
        self.reqs: list[Request] = []
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def answer(self, admitted: Callable[[], None]):
        """Submit, then answer. ``admitted()`` once the engine holds the requests (from then
        on ``Engine.load`` counts them), or once they were refused."""
        self._submit(admitted)
        if self.choices.stream:
            return StreamingResponse(self._events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._body()

    # -- submitting ---------------------------------------------------------------------------

    def _submit(self, admitted: Callable[[], None]) -> None:
        state, n, engine = self.state, self.choices.n, self.state.engine
        if self.want_lp and engine.drafter is not None:
            raise APIError(400, "'logprobs' is not supported with speculative decoding; serve without "
                           "--speculative to get logprobs", param="logprobs")
        admission = state.admission
        if n > 1 and admission.load() - 1 + n > admission.limit:  # this request already counts once
            raise APIError(429, f"server busy: n={n} choices do not fit the {admission.limit - admission.load() + 1} "
                           "free places; retry later or lower 'n'", "rate_limit_error", code="rate_limit_exceeded")
        p = self.params
        try:
            for i in range(n):
                params = p if p.seed is None or i == 0 else dataclasses.replace(p, seed=p.seed + i)
                self.reqs.append(engine.submit(self.ids, params, self._on_update_for(i)))
        except (RequestTooLong, QueueFull, ValueError) as e:
            for r in self.reqs:
                engine.abort(r)
            if isinstance(e, RequestTooLong):
                raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
            if isinstance(e, QueueFull):
                raise APIError(429, f"server busy: {e}", "rate_limit_error", code="rate_limit_exceeded") from None
            raise APIError(400, str(e)) from None
        finally:
            admitted()

    def _on_update_for(self, index: int):
        handed = [0]  # tokens of this choice handed out so far: updates come in order, after the step
        stream = self.choices.stream

        def on_update(req: Request, new_ids: list[int], text: str, finished: bool) -> None:  # engine thread
            lps = req.logprobs[handed[0]:handed[0] + len(new_ids)] if self.want_lp else None
            handed[0] += len(new_ids)
            if stream:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, new_ids, lps, text, finished))
            elif finished:
                self.loop.call_soon_threadsafe(self._end_one)
        return on_update

    def _end_one(self) -> None:
        self.ended += 1
        if self.ended == self.choices.n:
            self.finished.set()

    def _abort_all(self) -> None:
        for r in self.reqs:
            if not r.done.is_set():
                self.state.engine.abort(r)

    # -- answering ----------------------------------------------------------------------------

    def _usage(self) -> dict:
        prompt, out = len(self.ids), sum(len(r.output_ids) for r in self.reqs)
        self.request.scope.setdefault("state", {})["tokens"] = (prompt, out)  # for the access log
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    @staticmethod
    def _failure(req: Request) -> APIError:
        return APIError(500, f"generation failed: {req.error}", "server_error", code="generation_error")

    def _logprobs(self, token_ids: list[int], lps: list | None, offsets: TextOffsets | None) -> dict | None:
        if lps is None:
            return None
        if self.chat:
            return chat_logprobs(self.token_text, token_ids, lps)
        return completion_logprobs(self.token_text, token_ids, lps, offsets(token_ids))

    async def _body(self) -> dict:
        # Wait for the end or the client leaving, whichever comes first. (Waiting on the
        # token updates with a timeout and checking the connection on timeout never
        # checked it while tokens kept coming, so a gone client's request ran to the end.)
        finished = asyncio.ensure_future(self.finished.wait())
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
            if not finished.done():
                raise APIError(499, "client disconnected")
        finally:  # also when this handler is cancelled (server shutdown)
            finished.cancel()
            gone.cancel()
            self._abort_all()
        failed = next((r for r in self.reqs if r.finish_reason == "error"), None)
        if failed is not None:
            raise self._failure(failed)
        out = []
        for i, req in enumerate(self.reqs):
            self.state.observe(req)
            lp = self._logprobs(req.output_ids, req.logprobs if self.want_lp else None,
                                TextOffsets(self.state.tokenizer))
            choice = {"index": i, "finish_reason": req.finish_reason, "logprobs": lp}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": req.text}
            else:
                choice["text"] = req.text
            out.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.state.config.model_name,
                "choices": out, "usage": self._usage()}

    def _chunk(self, choice_list: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                "created": self.created, "model": self.state.config.model_name, "choices": choice_list}
        if self.choices.include_usage:  # OpenAI: null on every chunk but the last
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def _choice(self, index: int, text: str | None, finish: str | None, lp: dict | None = None,
                first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}

    async def _events(self):
        n, reqs = self.choices.n, self.reqs
        offsets = [TextOffsets(self.state.tokenizer) for _ in range(n)]
        try:
            if self.chat:
                for i in range(n):
                    yield self._chunk([self._choice(i, None, None, first=True)])
            left = n
            while left:
                index, new_ids, lps, text, finished = await self.queue.get()
                if text or (lps and new_ids):
                    yield self._chunk([self._choice(index, text, None, self._logprobs(new_ids, lps, offsets[index]))])
                if finished and reqs[index].finish_reason == "error":  # the headers are out: an error event
                    yield f"data: {json.dumps(self._failure(reqs[index]).body())}\n\n"
                    break
                if finished:
                    left -= 1
                    self.state.observe(reqs[index])
                    yield self._chunk([self._choice(index, None, reqs[index].finish_reason)])
            if left == 0 and self.choices.include_usage:
                yield self._chunk([], self._usage())
            else:
                self._usage()  # the access log's token counts
            yield "data: [DONE]\n\n"
        finally:  # also runs when the client goes away and the response task is cancelled
            self._abort_all()


async def _disconnected(request: HTTPRequest) -> None:
    """Return when the client goes away. Once the body is read, the server's ``receive``
    blocks until ``http.disconnect`` (or the response is complete), so this costs one
    suspended task, not a polling loop."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
