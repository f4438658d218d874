"""`python -m spaceserve.runtime.sim`: the image-rate sweep and figure (see `cli`)."""

import sys

from spaceserve.runtime.sim.cli import main

sys.exit(main())
