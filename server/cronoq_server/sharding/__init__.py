"""Sharding: between the API layers and this server's Node, which serves one shard only.

- router.py: ShardRouter, which picks each call's way to the shard that serves it (here, forwarded,
  asked of every shard and merged);
- peers.py: the channels to other shards and what a forwarded call carries and answers;
- pages.py: how the answers of a fan-out are joined;
- watch.py: Watch merged from every shard, with a composite cursor;
- call.py: what routing knows of a call (Call) and which shards a caller may know of (may_read).
"""

from .call import Call
from .peers import FORWARDED_HEADER
from .router import ShardRouter, unavailable_metadata

__all__ = ["FORWARDED_HEADER", "Call", "ShardRouter", "unavailable_metadata"]
