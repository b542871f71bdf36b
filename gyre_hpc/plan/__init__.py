"""What a recipe asks of the hardware before anything runs: the world's ranks (``world``), engine
replicas over a cell's GPUs (``placement``) and what one GPU and one node hold (``memory``)."""
