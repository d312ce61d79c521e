"""Request traces: one Arrow schema, loaders for public trace formats, synthetic workloads."""
