"""The GPU executor: runs the simulator's block tables through real paged kernels.

Not built yet (a later issue); the package exists so the layout matches DESIGN.md.
"""
