"""Unit tests: no server process, no store file beyond tmp_path."""
