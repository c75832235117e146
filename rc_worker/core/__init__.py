"""The pure core: decision logic with no I/O.

Nothing here imports trio, httpx, os, subprocess, socket or time;
tests/test_core_purity.py checks it.
"""
