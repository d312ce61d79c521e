"""Run outputs: the run directory's parquet files and their documented schema (SCHEMA.md),
text summaries, plots and the HTML report."""
