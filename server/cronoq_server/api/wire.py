"""Requests read from their protobuf bytes: a message that does not decode is INVALID_ARGUMENT
naming the field it breaks at, never an exception out of gRPC's deserializer (which answers
UNKNOWN or INTERNAL and logs a traceback)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from ..errors import ApiError

MALFORMED = "MALFORMED_MESSAGE"  # the ErrorInfo reason of a request that does not decode


def parse(message: type[Message], data: bytes) -> Message:
    """The message of these bytes; raises INVALID_ARGUMENT (reason MALFORMED) naming where
    they are malformed."""
    try:
        return message.FromString(data)
    except DecodeError as err:
        why = str(err).rpartition("': ")[2] or "not a protobuf message"
        where = broken_field(message.DESCRIPTOR, data) or message.DESCRIPTOR.name
        text = f"{where}: {why} (a malformed {message.DESCRIPTOR.full_name} of {len(data)} bytes)"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, text, reason=MALFORMED) from None


def broken_field(descriptor: Any, data: bytes, prefix: str = "") -> str | None:
    """The path of the first field at which data does not decode (e.g. "outcomes[1].failure.error":
    cut short, a wire type that cannot be, text that is not UTF-8); None if none is found."""
    pos, seen = 0, dict[int, int]()
    while pos < len(data):
        key, pos = _varint(data, pos)
        if key is None:
            return prefix.rstrip(".") or None
        number, wire = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = field.name if field is not None else f"field {number}"
        if field is not None and field.is_repeated:
            index = seen[number] = seen.get(number, -1) + 1
            name = f"{name}[{index}]"
        path = prefix + name
        if wire == 0:
            value, pos = _varint(data, pos)
            if value is None:
                return path
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            if length is None or pos + length > len(data):
                return path
            chunk, pos = data[pos : pos + length], pos + length
            if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode()
                except UnicodeDecodeError:
                    return path
            elif field is not None and field.message_type is not None:
                inner = broken_field(field.message_type, chunk, path + ".")
                if inner is not None:
                    return inner
        else:  # groups (proto2 only) or no wire type at all
            return path
        if pos > len(data):
            return path
    return None


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    """The varint at pos and the position after it; None when cut short or longer than 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        value |= (data[i] & 0x7F) << shift
        if data[i] < 0x80:
            return value, i + 1
        shift += 7
    return None, len(data)
