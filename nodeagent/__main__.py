"""`python -m nodeagent`: the same process as the `superfluid-noded` console script."""

import sys

from nodeagent.main import main

sys.exit(main())
