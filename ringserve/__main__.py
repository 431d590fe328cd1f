"""`python -m ringserve` is the `ringserve` command."""

from __future__ import annotations

import sys

from ringserve.cli import main

sys.exit(main())
