from __future__ import annotations

import sys

from poise.cli import main

sys.exit(main())
