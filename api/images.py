"""Images on the API: OpenAI's `image_url` content parts, read into the base64 images a backend takes.

Only inline images are accepted: a part's URL must be a `data:` URL with base64 bytes
(`data:image/png;base64,...`), whose bytes become the message's images as Ollama takes them
(base64 without the prefix). A remote URL is refused with a 400: the server fetches nothing, so
that no request can make it reach an address on a client's behalf.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from api.errors import BadRequestError

_HINT = 'send the image inline: {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}'


def part_images(parts: list[dict[str, Any]]) -> list[str]:
    """The base64 bytes of each `image_url` part, in order. BadRequestError for a remote URL or a
    data URL that is not base64."""
    images: list[str] = []
    for i, part in enumerate(parts):
        if part.get("type") != "image_url":
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise BadRequestError(f"content part {i} (image_url) has no url", param="messages", hint=_HINT)
        images.append(_inline(url, i))
    return images


def _inline(url: str, index: int) -> str:
    head, comma, data = url.partition(",")
    if not url.startswith("data:"):
        raise BadRequestError(
            f"content part {index} names a remote image ({url[:60]}): only inline data-URL images are "
            "accepted (the server fetches nothing)",
            param="messages",
            hint=_HINT,
        )
    if not comma or not head.endswith(";base64"):
        raise BadRequestError(
            f"content part {index} is a data URL without base64 bytes", param="messages", hint=_HINT
        )
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(
            f"content part {index} is a data URL whose bytes are not valid base64",
            param="messages",
            hint=_HINT,
        ) from None
    return data
