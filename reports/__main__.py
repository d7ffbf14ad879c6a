"""`python -m reports` is `megabench report`."""
import sys

from .report_cli import main

sys.exit(main())
