import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn


def test_mtlsize_defaults_and_shape():
    s = mn.MTLSize(5)
    assert (s.W, s.H, s.D) == (5, 1, 1)
    assert mn.MTLSize(4, 3, 2).shape == (2, 3, 4)
    assert mn.MTLSize(4, 3, 2).length == 24


@pytest.mark.parametrize("shape,dims", [((7,), (7, 1, 1)), ((3, 7), (7, 1, 3)), ((2, 3, 7), (7, 3, 2))])
def test_data_infers_dims_batch_first(shape, dims):
    """Plain arrays are batch-first as in mlx.nn: the batch is D, the features W."""
    d = mn.Data(mx.zeros(shape))
    assert tuple(d.dims) == dims
    assert d.array.shape == (dims[2], dims[1], dims[0])
    assert d.to_array(len(shape)).shape == shape  # and back


def test_data_explicit_dims_reshapes_and_checks_count():
    d = mn.Data(mx.arange(24), mn.MTLSize(4, 3, 2))
    assert d.array.shape == (2, 3, 4)
    assert d.array[1, 2, 3].item() == 23
    with pytest.raises(ValueError, match="24 elements"):
        mn.Data(mx.arange(23), mn.MTLSize(4, 3, 2))
    with pytest.raises(ValueError, match="1-D, 2-D or 3-D"):
        mn.Data(mx.zeros((1, 2, 3, 4)))


def test_image_layout_round_trips():
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 4)).astype(np.float32)
    d = mn.Data.from_nchw(mx.array(x))
    assert tuple(d.dims) == (4, 5, 6)
    np.testing.assert_array_equal(np.array(d.to_nchw(3)), x)
    nhwc = x.transpose(0, 2, 3, 1)
    d2 = mn.Data.from_nhwc(mx.array(nhwc))
    np.testing.assert_array_equal(np.array(d2.array), np.array(d.array))
    np.testing.assert_array_equal(np.array(d2.to_nhwc(3)), nhwc)
    with pytest.raises(ValueError, match="not a multiple"):
        d.to_nchw(4)


def test_device_keys_are_seeded_and_advance():
    a, b = mn.Device(seed=3), mn.Device(seed=3)
    ka1, kb1 = a.next_key(), b.next_key()
    assert np.array_equal(np.array(ka1), np.array(kb1))
    ka2 = a.next_key()
    assert not np.array_equal(np.array(ka1), np.array(ka2))
