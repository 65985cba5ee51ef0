"""The application layer, below both the command line and the benchmarks: a training job and its parts, simulation, profile, export."""
