"""``python -m gmmlsh.service``: the ``gmmlsh`` command line without the console script."""

import sys

from gmmlsh.service.cli import main

sys.exit(main())
