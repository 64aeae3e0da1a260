"""Test-only plugins living outside weightsync, importable only through PYTHONPATH (the Ray
workers get it from the session's runtime env, the driver from conftest)."""
