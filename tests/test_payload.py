"""tasks.payload.TaskMessage as queue entries hold it: an entry written before a field was added or
a default changed still reads as it was meant, and one without an id or a digest is malformed."""

from __future__ import annotations

import msgspec
import pytest

from dispatch.view import _size_decoder
from tasks.payload import Message, TaskMessage, decode_task, encode_task


def test_an_entry_queued_while_general_was_the_default_domain_reads_as_general() -> None:
    # What an earlier version queued for a task routed to "general": its default, so left out.
    old = msgspec.msgpack.encode(
        {"task_id": "t1", "model": "m", "digest": "d" * 64, "messages": [{"role": "user", "content": "hi"}]}
    )
    task = decode_task(old)
    assert task.domain is None and task.domain_or_general() == "general"
    assert _size_decoder.decode(old).domain == "general"
    # A domain routed now is written out, "general" included.
    routed = msgspec.structs.replace(task, domain="general")
    assert decode_task(encode_task(routed)).domain_or_general() == "general"
    assert _size_decoder.decode(encode_task(routed)).domain == "general"
    assert decode_task(encode_task(msgspec.structs.replace(task, domain="code"))).domain == "code"


def test_a_queued_task_without_an_id_is_malformed_though_a_request_has_none() -> None:
    request = TaskMessage(model="m", messages=[Message(role="user", content="hi")])
    assert (request.task_id, request.digest, request.domain) == ("", "", None)
    with pytest.raises(msgspec.ValidationError, match="task_id"):
        decode_task(msgspec.msgpack.encode({"model": "m", "digest": "d" * 64}))
    # A model its server reports no digest for is queued with an empty one, and runs.
    assert decode_task(msgspec.msgpack.encode({"task_id": "t1", "model": "m"})).digest == ""


def test_a_task_counts_the_images_of_its_prompt_and_of_its_messages() -> None:
    task = TaskMessage(
        model="m",
        images=["a"],
        messages=[Message(role="user", content="look", images=["b", "c"]), Message(role="user")],
    )
    assert task.image_count() == 3
