import sys

from llm.cli import main

sys.exit(main())
