"""Paged kernels (K/V write, paged attention, recurrent state update).

Not built yet (a later issue); the package exists so the layout matches DESIGN.md.
"""
