import sys

from nightjar_tools.cli import main

sys.exit(main())
