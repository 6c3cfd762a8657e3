"""`python -m ghosted_hf.cli`: the `ghosted` command."""

import sys

from . import main

sys.exit(main())
