"""`python -m server.openai`: the same as `python -m server.openai.serve`."""

import sys

from server.openai.serve import main

sys.exit(main())
