import sys

from gyre_hpc.executors.node import main

sys.exit(main())
