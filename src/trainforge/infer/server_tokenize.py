"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), behind the API key like the
rest. They run on their own threads under their own limit, ``max_tokenize_concurrent``
(``server_limits.TokenizerPool``; one more is a 429 before its body is read), so a flood
of large texts queues nothing else. Text longer than any prompt that fits the context is a
400 before it is tokenised; a tokenizer that fails on one text fails that request (400)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest  # at module level: FastAPI resolves annotations here

from trainforge.infer.openai_schema import APIError
from trainforge.infer.server_body import body_route
from trainforge.infer.server_limits import TokenizerFailed
from trainforge.infer.server_protocol import DetokenizeRequest, TokenizeRequest, chat_prompt
from trainforge.infer.server_state import state_of

router = APIRouter(route_class=body_route(lambda state: state.tokenizer_pool.check), tags=["tokenizer"])


@router.post("/tokenize", summary="Token ids of a prompt, or of a chat as the chat endpoint renders it")
async def tokenize(body: TokenizeRequest, request: HTTPRequest):
    state = state_of(request)
    if body.messages is not None:
        text, param = chat_prompt(body.messages), "messages"
    else:
        text, param = body.prompt, "prompt"
    state.check_text(text, param)
    with state.tokenizer_pool.slot():
        ids = await state.encode(text, param, state.tokenizer_pool)
    # A JSONResponse, not a dict: FastAPI's jsonable_encoder took 184 ms per 250,000 ids on the loop.
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids})


@router.post("/detokenize", summary="The text of token ids")
async def detokenize(body: DetokenizeRequest, request: HTTPRequest):
    state = state_of(request)
    V = state.engine.model.cfg.vocab_size
    if not all(0 <= t < V for t in body.tokens):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {V})", param="tokens")
    with state.tokenizer_pool.slot():
        try:
            return {"prompt": await state.tokenizer_pool.run(state.tokenizer.decode, body.tokens)}
        except TokenizerFailed as e:
            raise APIError(400, f"the server's tokenizer failed on these ids ({e})", param="tokens") from None
