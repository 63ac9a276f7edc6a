"""``POST /v1/chat/completions`` as vLLM-Omni's text-to-image path: the request's last
user message is the prompt (an image part in it makes the request an edit), the answer a
chat completion whose message content lists the images as ``image_url`` parts."""

from __future__ import annotations

import base64
import secrets
import time
from typing import Any

from .errors import APIError
from .uploads import MAX_IMAGES, Upload, check_count

__all__ = ["CHAT_IGNORED", "chat_completion", "chat_request"]

CHAT_IGNORED = frozenset({"temperature", "top_p", "max_tokens", "max_completion_tokens",
                          "presence_penalty", "frequency_penalty", "stop", "logprobs",
                          "top_logprobs", "modalities"})
"""Chat fields with no meaning for an image model: accepted and ignored."""

_MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}.", param=param, code="invalid_value")


def _data_url(url: Any, where: str) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise _bad(where, "send the image as a data URL (data:image/png;base64,...); this "
                          "server does not fetch URLs")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except ValueError:
        raise _bad(where, "the data URL is not valid base64") from None


def chat_request(body: Any, max_images: int = MAX_IMAGES) -> tuple[dict[str, Any], list[Upload]]:
    """``(fields, images)``: the images request the chat body stands for (``prompt`` set
    from the last user message, the chat-only fields dropped) and that message's images,
    each named by its part (``messages[1].content[2]``), not yet decoded.

    Raises:
        APIError: 400: not an object, no ``messages`` list, no user message, a message
            part of an unknown type, more than ``max_images`` image parts (counted before
            any is decoded), an image that is not a data URL, or no text.
    """
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                       code="missing_required_parameter")
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise _bad("messages", "there is no message with role 'user'")
    index = users[-1]
    content = messages[index].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise _bad(f"messages[{index}].content", "a string or a list of parts")
    count = sum(1 for p in parts if isinstance(p, dict) and p.get("type") == "image_url")
    check_count(f"messages[{index}].content", count, max_images, "image parts")
    texts, images = [], []
    for j, part in enumerate(parts):
        where = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            images.append(Upload(where, _data_url(url.get("url") if isinstance(url, dict) else url,
                                                  where)))
        else:
            raise _bad(where, "a part must be {'type': 'text', 'text': ...} or "
                              "{'type': 'image_url', 'image_url': {'url': 'data:...'}}")
    prompt = "\n".join(t for t in texts if t.strip())
    if not prompt:
        raise _bad(f"messages[{index}].content", "the last user message has no text")
    fields = {k: v for k, v in body.items() if k != "messages" and k not in CHAT_IGNORED}
    return {**fields, "prompt": prompt}, images


def chat_completion(model: str, images: list[bytes], fmt: str) -> dict[str, Any]:
    """The chat completion carrying ``images``: one assistant choice whose content is a
    list with one ``image_url`` part (a data URL) per image."""
    mime = _MIME[fmt]
    content = [{"type": "image_url",
                "image_url": {"url": f"data:{mime};base64,{base64.b64encode(i).decode('ascii')}"}}
               for i in images]
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
