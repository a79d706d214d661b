"""``python -m gradpool ...`` is the ``gradpool`` command (see :mod:`gradpool.app.cli`); the one
core module that reaches up into the application, as an entry point."""
import sys

from gradpool.app.cli import main

sys.exit(main())
