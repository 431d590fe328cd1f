"""Test-wide setup. Triton's interpreter must be chosen before any kernel is
decorated, so it is set here, ahead of every import of ringserve.kernels.
The suite runs two workers on two cores, so every process it starts (rank
processes included, through the environment) uses one torch thread."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
