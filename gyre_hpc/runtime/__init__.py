"""The MPI runtime: one world, rank 0 the controller, the other ranks grouped into cells."""
