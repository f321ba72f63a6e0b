"""``python -m pagedhybrid ...`` runs the command line, as ``pagedhybrid ...`` does."""

from __future__ import annotations

import sys

from pagedhybrid.cli import main

if __name__ == "__main__":
    sys.exit(main())
