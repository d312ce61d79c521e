"""Request traces: one Arrow schema, loaders for public trace formats, synthetic workloads.

``schema`` holds the columns (documented in SCHEMA.md), ``load.load_trace`` reads any
supported file, ``synth`` generates workloads (SYNTH.md), ``transforms`` cuts and combines
traces, ``stats`` is what ``kvtwin trace info`` reports, and ``expand`` turns block hashes
into ids at another block size or into pseudo token ids. This package depends only on
pyarrow, numpy and the standard library.
"""
