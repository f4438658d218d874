"""`python -m bench.attack [--quick] [--json out.json] [--port 8321]` (see `bench.attack.run`)."""

from __future__ import annotations

import sys

from bench.attack.run import main

if __name__ == "__main__":
    sys.exit(main())
