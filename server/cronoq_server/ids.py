"""Task ids: the shard number in the top 8 bits, a per-shard sequence below."""

SHARD_BITS = 8
SEQ_BITS = 64 - SHARD_BITS
SEQ_MASK = (1 << SEQ_BITS) - 1
MAX_ID = (1 << 64) - 1


def make_task_id(shard_number: int, seq: int) -> int:
    return (shard_number << SEQ_BITS) | seq


def shard_of(task_id: int) -> int:
    return task_id >> SEQ_BITS


def seq_of(task_id: int) -> int:
    return task_id & SEQ_MASK


def parse_task_id(text: str) -> int:
    """Parses a decimal task id; raises ValueError naming the value."""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_ID or int(text) == 0:
        raise ValueError(f"task id {text!r} is not a positive unsigned 64-bit decimal integer")
    return int(text)
