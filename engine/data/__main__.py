"""``python -m hookloop.engine.data``: prepare token files (see :mod:`engine.data.prepare`)."""

import sys

from hookloop.engine.data.prepare import main

sys.exit(main())
