import sys

from convert.cli import main

sys.exit(main())
