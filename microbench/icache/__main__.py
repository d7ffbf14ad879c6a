"""`python -m microbench.icache precompile [--full]` is `megabench icache precompile` (precompile.py)."""
import sys

from .precompile import main

sys.exit(main())
