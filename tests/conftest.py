"""Test-wide setup. Triton's interpreter must be chosen before any kernel is
decorated, so it is set here, ahead of every import of ringserve.kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
