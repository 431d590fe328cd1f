"""Test-wide setup. Triton's interpreter must be chosen before any kernel is
decorated, so it is set here, ahead of every import of ringserve.kernels.
The suite runs two workers on two cores, so every process it starts (rank
processes included, through the environment) uses one torch thread. A suite
started in the background of a script inherits SIGINT ignored (POSIX shells
ignore it in asynchronous commands), and so would every process it starts,
which the Ctrl-C tests need to take it: the handler is put back here."""

from __future__ import annotations

import os
import signal

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
