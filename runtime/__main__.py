"""``python -m ftcompile.runtime PACKAGE``: one rank of a training run (see :mod:`.worker`)."""

import sys

from .worker import main

sys.exit(main())
