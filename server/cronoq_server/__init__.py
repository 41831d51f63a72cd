"""cronoq server: a durable task queue with one leader per shard."""

__version__ = "0.1.0"
