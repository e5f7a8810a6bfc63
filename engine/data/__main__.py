"""``python -m engine.data``: prepare token files (see :mod:`engine.data.prepare`)."""

import sys

from engine.data.prepare import main

sys.exit(main())
