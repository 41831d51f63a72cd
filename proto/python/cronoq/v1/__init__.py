"""Generated from proto/cronoq/v1 by `nox -s proto`; do not edit."""
