"""``python -m trainer``: the training command line (see :mod:`trainer.cli`)."""

import sys

from trainer.cli import main

sys.exit(main())
