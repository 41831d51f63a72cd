"""Requests read from their protobuf bytes: a message that does not decode is INVALID_ARGUMENT
naming the field it breaks at, never an exception out of gRPC's deserializer (which answers
UNKNOWN or INTERNAL and logs a traceback)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from ..core.limits import ListCap, RequestLimit
from ..errors import ApiError

MALFORMED = "MALFORMED_MESSAGE"  # the ErrorInfo reason of a request that does not decode
TOO_LARGE = "REQUEST_TOO_LARGE"  # the ErrorInfo reason of a request over its method's limit


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


def check_unparsed(rpc_name: str, message: type[Message], data: bytes, limit: RequestLimit) -> None:
    """Refuses, before data is parsed, a request over its method's limit: larger than its bytes
    (RESOURCE_EXHAUSTED), or with a list longer than its cap (INVALID_ARGUMENT, counted on the wire)."""
    if len(data) > limit.max_bytes:
        raise ApiError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{rpc_name}: a request of {len(data)} bytes, more than the {limit.max_bytes} bytes "
            f"this server reads for {rpc_name} ({limit.basis})",
            reason=TOO_LARGE,
        )
    over = _over_cap(message.DESCRIPTOR, [memoryview(data)], limit.lists) if limit.lists else None
    if over is not None:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{over.field}: more than {over.limit} {over.what} in one message",
            reason=TOO_LARGE,
        )


def _over_cap(descriptor: Any, parts: list[memoryview], caps: tuple[ListCap, ...]) -> ListCap | None:
    """A cap whose list the message of these parts (occurrences merged, as a parse merges them)
    holds far more entries of: more than twice the caps' entries and each other field once. The
    walk stops there, so it costs at most that, whatever the message's size; a list a little
    over its cap is left to the parse, which is then cheap, and to the core's check, which says
    how many there are. A list fits without a walk in bytes too few to hold that many entries
    (2 bytes an entry)."""
    size = sum(len(p) for p in parts)
    level = [c for c in caps if size > 4 * c.limit]
    if not level:
        return None
    fields = {c.field: descriptor.fields_by_name[c.field.partition(".")[0]] for c in level}
    nested = {f.number for name, f in fields.items() if "." in name}
    budget = 2 * sum(c.limit for c in level if "." not in c.field) + len(descriptor.fields) + 1
    counts: dict[int, int] = {}
    inner: dict[int, list[memoryview]] = {}
    for part in parts:
        budget = _count(part, counts, nested, inner, budget)
        if budget < 0:
            break
    for cap in level:
        field = fields[cap.field]
        rest = cap.field.partition(".")[2]
        if rest:
            if _over_cap(field.message_type, inner.get(field.number, []), (ListCap(rest, cap.limit, cap.what),)):
                return cap
        elif budget < 0 and counts.get(field.number, 0) > cap.limit:
            return cap
    if budget < 0:
        return ListCap(descriptor.name, len(descriptor.fields), "fields besides its lists")
    return None


def _count(
    data: memoryview, counts: dict[int, int], nested: set[int], inner: dict[int, list[memoryview]], budget: int
) -> int:
    """Adds the entries of data's top level to counts by field number, and the bytes of the
    `nested` ones to inner; returns the budget left (negative: there were more entries). Bytes
    that do not decode end the count: the parse that follows names where."""
    pos, end = 0, len(data)
    while pos < end:
        budget -= 1
        if budget < 0:
            return budget
        key: int | None = data[pos]  # one-byte varints inline: a walk is over many small entries
        pos += 1
        if key is not None and key >= 0x80:
            key, pos = _varint(data, pos - 1)
        if key is None:
            return budget
        number, wire = key >> 3, key & 7
        if wire == 2:
            length: int | None = data[pos] if pos < end else 0x80
            if length is not None and length < 0x80:
                start = pos + 1
            else:
                length, start = _varint(data, pos)
            if length is None:
                return budget
            pos = start + length
            if number in nested and pos <= end:
                inner.setdefault(number, []).append(data[start:pos])
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
        else:
            return budget
        counts[number] = counts.get(number, 0) + 1
    return budget


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


def _varint(data: bytes | memoryview, pos: int) -> tuple[int | None, int]:
    """The varint at pos and the position after it; None when cut short or longer than 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        value |= (data[i] & 0x7F) << shift
        if data[i] < 0x80:
            return value, i + 1
        shift += 7
    return None, len(data)
