"""``python -m service``: the ``gmmlsh`` command line without the console script."""

import sys

from service.cli import main

sys.exit(main())
