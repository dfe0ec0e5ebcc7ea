"""The buffer-built helpers of ``maxent_arrow.arrow.lists`` agree with pyarrow's own
conversions (sliced, chunked, with nulls) and, unlike them, import no pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from maxent_arrow.arrow import float_values, list_offsets


@pytest.mark.parametrize(
    "array",
    [
        pa.array([1.5, None, -2.0, float("inf"), 4.0], pa.float64()),
        pa.array([1.5, None, -2.0, 3.25], pa.float32()),
        pa.array([7, None, -3, 2**40], pa.int64()),
        pa.array([1, 2, None, 4, 5, 6, 7, 8, 9], pa.int32()),
        pa.array([3, -4, 5], pa.int16()),
        pa.array([1, None, -1], pa.int8()),
        pa.array([True, False, None, True, True, False, True, False, True, True]),
    ],
    ids=lambda a: str(a.type),
)
@pytest.mark.parametrize("cut", [None, (1, 3), (2, 0)])
def test_float_values_agree_with_pyarrow(array, cut):
    if cut is not None:
        array = array.slice(*cut)
    expected = array.cast(pa.float64()).to_numpy(zero_copy_only=False)
    got = float_values(array)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)  # NaN where null, in the same places
    chunked = pa.chunked_array([array, array])
    np.testing.assert_array_equal(float_values(chunked), np.concatenate([expected, expected]))


def test_float_values_refuse_what_is_not_a_number():
    with pytest.raises(TypeError, match="string is not a number column"):
        float_values(pa.array(["1"]))


@pytest.mark.parametrize("kind", [pa.list_(pa.int32()), pa.large_list(pa.int32())])
@pytest.mark.parametrize("cut", [None, (1, 3), (4, 0), (0, 1)])
def test_list_offsets_are_rebased_and_agree_with_pyarrow(kind, cut):
    array = pa.array([[1, 2], [3], [], None, [4, 5, 6]], kind)
    if cut is not None:
        array = array.slice(*cut)
    raw = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    got = list_offsets(array)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, raw - raw[0])
    assert got[-1] == len(array.flatten())


def test_the_helpers_import_no_pandas():
    """In a new interpreter: building arrays from buffers, then reading them back."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        from maxent_arrow.arrow import float_values, int64_array, list_offsets, text_scalar
        ids = int64_array(np.arange(6))
        lists = pa.ListArray.from_arrays(int64_array([0, 2, 6]).cast(pa.int32()), ids)
        assert list_offsets(lists.slice(1)).tolist() == [0, 4]
        assert float_values(pc.equal(pa.chunked_array([ids]), ids)).sum() == 6
        assert float_values(ids.slice(2)).tolist() == [2.0, 3.0, 4.0, 5.0]
        assert text_scalar("x").as_py() == "x"
        print("pandas" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"
