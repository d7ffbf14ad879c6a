"""`python -m reports` is `megabench report`."""
import sys

from .cli import main

sys.exit(main())
