import json

import pytest

from antiphon.server import protocol
from antiphon.server.errors import ApiError, ErrorCode


def decode(obj: object) -> protocol.ClientMessage:
    return protocol.decode_client_message(json.dumps(obj))


def test_decodes_each_client_message() -> None:
    assert isinstance(decode({"type": "session.open"}), protocol.SessionOpen)
    assert isinstance(decode({"type": "session.list"}), protocol.SessionList)
    msg = decode({"type": "message", "session_id": "s_1", "content": "hi", "max_tokens": 5})
    assert isinstance(msg, protocol.ChatMessage) and msg.max_tokens == 5
    assert isinstance(decode({"type": "typing", "session_id": "s_1"}), protocol.Typing)
    assert isinstance(decode({"type": "cancel", "request_id": "r_1"}), protocol.Cancel)


@pytest.mark.parametrize(("raw", "code"), [
    ("{nope", ErrorCode.BAD_JSON),
    (b"\xff\xfe", ErrorCode.BAD_JSON),
    ("[1, 2]", ErrorCode.BAD_MESSAGE),
    ('{"type": "launch"}', ErrorCode.UNKNOWN_TYPE),
    ('{"content": "no type"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "message", "session_id": "s_1"}', ErrorCode.BAD_MESSAGE),
    ('{"type": "message", "session_id": "../etc", "content": "x"}', ErrorCode.BAD_MESSAGE),
    ('{"type": "message", "session_id": "s", "content": "x", "max_tokens": 0}',
     ErrorCode.BAD_MESSAGE),
    ('{"type": "message", "session_id": "s", "content": "x", "temperature": 9}',
     ErrorCode.BAD_MESSAGE),
    ('{"type": "typing", "session_id": "s", "extra": 1}', ErrorCode.BAD_MESSAGE),
])
def test_rejects_bad_frames_with_typed_codes(raw: str | bytes, code: ErrorCode) -> None:
    with pytest.raises(ApiError) as info:
        protocol.decode_client_message(raw)
    assert info.value.code == code
    assert info.value.message


def test_error_frame_round_trips() -> None:
    frame = json.loads(protocol.error_frame(ApiError(ErrorCode.TOO_LARGE, "big"), "r_1"))
    assert frame == {"type": "error", "code": "too_large", "message": "big", "request_id": "r_1"}
