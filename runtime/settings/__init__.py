"""What a run is told: the typed job configuration, the system policies (which bound each system keeps),
simulation workloads and the placement plan."""
