from gyre_hpc.cli.app import main

main()
