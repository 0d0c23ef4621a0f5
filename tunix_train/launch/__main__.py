"""python -m tunix_train.launch: the local launcher (local.py)."""

import sys

from tunix_train.launch.local import main

sys.exit(main())
