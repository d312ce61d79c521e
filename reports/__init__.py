"""Turns run outputs into tables, parquet and HTML reports.

Not built yet (a later issue); the package exists so the layout matches DESIGN.md.
"""
