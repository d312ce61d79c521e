"""Comparing Arrow tables in tests: same columns, types and values, NaN equal to NaN."""

import numpy as np
import pyarrow as pa


def assert_tables_equal(a: pa.Table, b: pa.Table, *, with_metadata: bool = True) -> None:
    assert a.column_names == b.column_names
    if with_metadata:
        assert a.schema == b.schema
    else:
        assert a.schema.remove_metadata() == b.schema.remove_metadata()
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        if pa.types.is_floating(x.type):
            assert np.array_equal(x.to_numpy(), y.to_numpy(), equal_nan=True), name
        else:
            assert x.to_pylist() == y.to_pylist(), name
