// Rotary position embedding (same semantics as mx.fast.rope).
// x is [batch, T, D] row-contiguous (batch = product of the leading axes). The first `dims`
// features of each row are rotated in pairs by angle (offset + t) * scale * inv_freq[i]; the rest
// are copied. Pairs are (i, i + dims/2) by default, (2i, 2i+1) when TRADITIONAL.
// The backward pass is the inverse rotation: the same kernel with FORWARD = false.
// Grid: x over half + (D - dims) (rotated pairs, then copied features), y over T, z over batch.

// @kernel rope
// @inputs x, inv_freq, offset, scale, seq_len, feature_dim, rot_dims
// @outputs y
// Template: T (dtype of x and y), TRADITIONAL (bool), FORWARD (bool).
  uint idx = thread_position_in_grid.x;
  uint t = thread_position_in_grid.y;
  uint b = thread_position_in_grid.z;
  uint D = uint(feature_dim);
  uint dims = uint(rot_dims);
  uint half_dims = dims / 2;
  if (idx >= half_dims + (D - dims) || t >= uint(seq_len)) {
    return;
  }
  size_t row = (size_t(b) * uint(seq_len) + t) * D;
  if (idx >= half_dims) {
    uint j = dims + (idx - half_dims);
    y[row + j] = x[row + j];
    return;
  }
  uint i1 = TRADITIONAL ? 2 * idx : idx;
  uint i2 = TRADITIONAL ? 2 * idx + 1 : idx + half_dims;
  float position = (float(offset) + float(t)) * scale;
  float theta = position * inv_freq[idx];
  float c = metal::cos(theta);
  float s = FORWARD ? metal::sin(theta) : -metal::sin(theta);
  float a = float(x[row + i1]);
  float e = float(x[row + i2]);
  y[row + i1] = static_cast<T>(a * c - e * s);
  y[row + i2] = static_cast<T>(a * s + e * c);
