"""The device executor: runs the simulator's own scheduler output and block tables through
real paged kernels on a GPU (or the torch reference on a CPU), and the checks of
``kvtwin validate`` that compare it with the simulator (``validate``, ``memory``).
"""
