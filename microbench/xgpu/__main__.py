"""`torchrun --nproc-per-node=<GPUs> -m microbench.xgpu [--full]` (or `megabench xgpu`)."""
import sys

from .bench import main

sys.exit(main())
