"""``python -m autoplan.bench plan|apply|overhead|memory|compare ...``: runs the benchmarks' ``main``."""

import sys

from autoplan.bench import main

sys.exit(main())
