"""Ready-made training programs: what ``mltuner tune`` and the benchmarks run."""
