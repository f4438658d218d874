"""`python -m bench.kernels`: the kernel demo from the source tree (= `spaceserve demo`).

The demo lives in the package (`spaceserve.bench.demo`, its cases in
`spaceserve.bench.kernel_cases`); this entry point keeps the source-tree command working.
"""

from __future__ import annotations

import sys

from spaceserve.bench.demo import main

if __name__ == "__main__":
    sys.exit(main())
