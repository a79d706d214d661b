"""``python -m gradpool ...`` is the ``gradpool`` command (see :mod:`gradpool.cli`)."""
import sys

from gradpool.cli import main

sys.exit(main())
