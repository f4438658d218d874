"""`python -m spaceserve.runtime.sim`: the image-rate sweep and figure (see `cli`)."""

import sys

from .cli import main

sys.exit(main())
