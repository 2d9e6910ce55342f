"""``python -m tools.functional_tests run ...``: the runner's command line."""

import sys

from tools.functional_tests.runner import main

sys.exit(main())
