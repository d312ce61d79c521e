"""Run outputs: the run directory's parquet files and their documented schema (SCHEMA.md)."""
