"""Data files: GPU and model presets with their sources."""
