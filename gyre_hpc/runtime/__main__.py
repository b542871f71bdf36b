import sys

from gyre_hpc.runtime.main import main

sys.exit(main())
