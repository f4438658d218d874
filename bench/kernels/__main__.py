"""`python -m bench.kernels`: the kernel demo from the source tree (= `spaceserve demo`).

The demo lives in the package (`spaceserve.bench.kernels.demo`, its cases in
`spaceserve.bench.kernels.cases`); this entry point keeps the source-tree command working.
"""

from __future__ import annotations

import sys

from spaceserve.bench.kernels.demo import main

if __name__ == "__main__":
    sys.exit(main())
