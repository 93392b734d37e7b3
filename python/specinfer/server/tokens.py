"""POST /tokenize and POST /detokenize (vLLM's routes): a prompt's token ids as generation would
count them, and the text of token ids.

/tokenize takes `prompt` (text or token ids, as /v1/completions) or `messages` (with `tools`
and `tool_choice`, rendered as /v1/chat/completions renders them) and answers {"count",
"max_model_len", "tokens"}; /detokenize takes `tokens` and answers {"prompt"}.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from specinfer.server.errors import APIError, invalid
from specinfer.server.protocol import ChatCompletionRequest

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # a chat request's fields, read by its own model
    model: StrictStr
    prompt: StrictStr | list[int] | None = None
    messages: list | None = None


class DetokenizeRequest(BaseModel):
    model: StrictStr
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either 'prompt' or 'messages'", "prompt")
    prompt, param = body.prompt, "prompt"
    if body.messages is not None:
        prompt, param = _chat_prompt(body, state.engine.tokenizer), "messages"
    try:
        ids = state.engine.prompt_ids(prompt)
    except ValueError as e:
        raise APIError(400, str(e), param) from e
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    vocab = state.engine.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _chat_prompt(body: TokenizeRequest, tokenizer):
    """The messages as the chat route renders them (its checks, tools included)."""
    try:
        chat = ChatCompletionRequest.model_validate(body.model_dump())
    except ValidationError as e:
        raise invalid(e) from e
    return chat.chat_prompt(tokenizer)
