from gyre_hpc.launch.leave import leave
from gyre_hpc.runtime.main import main

leave(main())
