import sys

from fxtron.cli import main

sys.exit(main())
