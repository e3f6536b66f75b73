"""`python -m daemon.service ...` is `councild service ...`."""

import sys

from . import main

sys.exit(main())
