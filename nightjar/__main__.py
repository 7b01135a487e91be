import sys

from nightjar.cli import main

sys.exit(main())
