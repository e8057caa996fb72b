"""The API server under a wave of long R3 responses: ``prime_r3.bench.wave`` (its docstring
says what it runs and measures), as ``prime-r3 bench wave ARGS``."""

from __future__ import annotations

import sys

from prime_r3.bench.wave import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
