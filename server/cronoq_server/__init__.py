"""cronoq server: a durable task queue with one leader per shard."""

from importlib.metadata import version

__version__ = version("cronoq-server")  # the installed distribution's: one place sets it (VERSION)
