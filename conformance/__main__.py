"""`python -m conformance` is `superfluid-conformance`."""

import sys

from conformance.cli import main

sys.exit(main())
