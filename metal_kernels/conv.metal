// Convolution (PyTorch layouts, channels-first) as implicit GEMMs: forward, input gradient (dgrad,
// which is also the transposed convolution's forward) and weight gradient (wgrad).
//
// Geometry: one convolution x [N, C, D, H, W] * w [O, C/G, KD, KH, KW] -> y [N, O, OD, OH, OW]
// with per-axis stride S*, zero padding P*, dilation D*, G groups. 1-D and 2-D convolutions are
// the cases D = KD = OD = 1 (and H = KH = OH = 1). The 23 sizes come in `params` (int32, layout
// in conv_geom below) so one compiled variant per dtype serves every shape.
// With Cg = C/G, Og = O/G, KK = KD*KH*KW, P = OD*OH*OW, S = D*H*W, per group g:
//   conv2d_forward:  y[n, o, p]    = sum_{k=(c,r)}   w[o, c, r] * x[n, c, at(p, r)]
//                    GEMM  M = Og (o)  x  N = N*P (n, p)  x  K = Cg*KK (c, r)
//   conv2d_dgrad:    dx[n, c, q]   = sum_{k=(o,r)}   w[o, c, r] * dy[n, o, p(q, r)]
//                    GEMM  M = Cg (c)  x  N = N*S (n, q)  x  K = Og*KK (o, r); p(q, r) is the
//                    output pixel whose window puts kernel offset r on q (none -> 0): a gather, so
//                    every dx element has one owner and no atomics are needed.
//   conv2d_wgrad:    dw[o, c, r]   = sum_{k=(n,p)}   dy[n, o, p] * x[n, c, at(p, r)]
//                    GEMM  M = Og (o)  x  N = Cg*KK (c, r)  x  K = N*P (n, p), split along K
//                    into `KPS`-long slices (grid z = G * splits); each slice writes a float32
//                    partial dwp[split, O, Cg*KK] that the caller sums.
//
// Mapping shared by the three kernels: a threadgroup of 128 threads (4 SIMD groups) computes a
// CONV_BM x CONV_BN = 32 x 32 tile of C = A @ B; grid = (tiles along N * 128, tiles along M,
// G [* splits]), threadgroup = (128, 1, 1). The K axis is walked in CONV_BK = 16 chunks: all 128
// threads gather the A chunk [32 x 16] and the B chunk [16 x 32] (implicit im2col; out-of-range
// and padding positions read as 0) into threadgroup memory as float, a barrier, then each SIMD
// group multiplies its 16 x 16 quarter with 2 x 2 simdgroup_float8x8 accumulators (2 k-steps of
// 8), a barrier. At the end the accumulators go through threadgroup memory to the guarded global
// writes. Every loop containing a barrier has bounds uniform over the threadgroup and threads past
// the edges only skip their loads/stores (with ifs; there is no early return); the tile grid is
// a whole number of threadgroups, so every SIMD group is full at the simdgroup_matrix calls.
// Loads: for B of forward/dgrad each thread owns one column (pixel) of the chunk, consecutive
// threads take consecutive pixels (coalesced reads of x / dy along W), its pixel decoded once.
// Accumulation is in float whatever T is; T is the dtype of x, w, dy and of y / dx.
// Inputs are indexed from their base pointer with size_t offsets (no derived `device T*`
// pointers): MLX passes inputs of fewer than 8 elements in the `constant` address space.

// @header
#define CONV_BM 32
#define CONV_BN 32
#define CONV_BK 16
#define CONV_THREADS 128
// Row stride of the B chunk: 33 so that wgrad's column-wise stores (16 threads down one column)
// hit 16 different banks.
#define CONV_LDB (CONV_BN + 1)

struct ConvGeom {
  int N, C, D, H, W, O, OD, OH, OW, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, G, KPS;
  int Cg, Og, KK, S, P;
};

// params: N, C, D, H, W, O, OD, OH, OW, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, G, KPS.
inline ConvGeom conv_geom(const device int* p) {
  ConvGeom g;
  g.N = p[0];   g.C = p[1];   g.D = p[2];   g.H = p[3];   g.W = p[4];   g.O = p[5];
  g.OD = p[6];  g.OH = p[7];  g.OW = p[8];  g.KD = p[9];  g.KH = p[10]; g.KW = p[11];
  g.SD = p[12]; g.SH = p[13]; g.SW = p[14]; g.PD = p[15]; g.PH = p[16]; g.PW = p[17];
  g.DD = p[18]; g.DH = p[19]; g.DW = p[20]; g.G = p[21];  g.KPS = p[22];
  g.Cg = g.C / g.G;
  g.Og = g.O / g.G;
  g.KK = g.KD * g.KH * g.KW;
  g.S = g.D * g.H * g.W;
  g.P = g.OD * g.OH * g.OW;
  return g;
}

// Split a row-major index over (a, b, c) with sizes (*, nb, nc).
inline int3 conv_split3(int i, int nb, int nc) {
  int a = i / (nb * nc);
  int rest = i - a * nb * nc;
  int b = rest / nc;
  return int3(a, b, rest - b * nc);
}

inline void conv_zero_acc(thread simdgroup_float8x8* acc) {
  for (int i = 0; i < 4; ++i) {
    acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}

// acc[2*i + j] += A[sm*16 + 8i .. +8, :] @ B[:, sn*16 + 8j .. +8] for the staged chunk.
// As is [CONV_BM][CONV_BK], Bs is [CONV_BK][CONV_LDB] (row-major, float; columns CONV_BN..LDB-1
// unused).
inline void conv_mma(thread simdgroup_float8x8* acc, const threadgroup float* As,
                     const threadgroup float* Bs, int sm, int sn) {
  for (int kk = 0; kk < CONV_BK; kk += 8) {
    simdgroup_float8x8 a0;
    simdgroup_float8x8 a1;
    simdgroup_float8x8 b0;
    simdgroup_float8x8 b1;
    simdgroup_load(a0, As + (sm * 16) * CONV_BK + kk, CONV_BK);
    simdgroup_load(a1, As + (sm * 16 + 8) * CONV_BK + kk, CONV_BK);
    simdgroup_load(b0, Bs + kk * CONV_LDB + sn * 16, CONV_LDB);
    simdgroup_load(b1, Bs + kk * CONV_LDB + sn * 16 + 8, CONV_LDB);
    simdgroup_multiply_accumulate(acc[0], a0, b0, acc[0]);
    simdgroup_multiply_accumulate(acc[1], a0, b1, acc[1]);
    simdgroup_multiply_accumulate(acc[2], a1, b0, acc[2]);
    simdgroup_multiply_accumulate(acc[3], a1, b1, acc[3]);
  }
}

// Write the SIMD group's 16 x 16 quarter into Cs [CONV_BM][CONV_BN].
inline void conv_store_acc(thread simdgroup_float8x8* acc, threadgroup float* Cs, int sm, int sn) {
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      simdgroup_store(acc[2 * i + j], Cs + (sm * 16 + 8 * i) * CONV_BN + sn * 16 + 8 * j, CONV_BN);
    }
  }
}

// @kernel conv2d_forward
// @inputs x, w, params
// @outputs y
// Template: T. Grid (ceil(N*P / 32) * 128, ceil(Og / 32), G).
  threadgroup float As[CONV_BM * CONV_BK];
  threadgroup float Bs[CONV_BK * CONV_LDB];
  threadgroup float Cs[CONV_BM * CONV_BN];
  const ConvGeom s = conv_geom(params);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int sm = sg / 2;
  const int sn = sg % 2;
  const int g = int(threadgroup_position_in_grid.z);
  const int m0 = int(threadgroup_position_in_grid.y) * CONV_BM;
  const int n0 = int(threadgroup_position_in_grid.x) * CONV_BN;
  const int Kdim = s.Cg * s.KK;
  const int Ncols = s.N * s.P;

  // This thread's B column: one output pixel (n, od, oh, ow).
  const int bcol = tid % CONV_BN;
  const int brow0 = tid / CONV_BN;  // chunk rows brow0 + 4 * i
  const int j = n0 + bcol;
  const bool jok = j < Ncols;
  const int bn = jok ? j / s.P : 0;
  const int p = jok ? j - bn * s.P : 0;
  const int3 op = conv_split3(p, s.OH, s.OW);
  const int id0 = op.x * s.SD - s.PD;
  const int ih0 = op.y * s.SH - s.PH;
  const int iw0 = op.z * s.SW - s.PW;
  const size_t xb = (size_t(bn) * size_t(s.C) + size_t(g) * size_t(s.Cg)) * size_t(s.S);
  // This thread's A column (k within the chunk) and rows arow0 + 8 * i.
  const int acol = tid % CONV_BK;
  const int arow0 = tid / CONV_BK;
  const size_t wg = size_t(g) * size_t(s.Og) * size_t(Kdim);

  simdgroup_float8x8 acc[4];
  conv_zero_acc(acc);
  for (int k0 = 0; k0 < Kdim; k0 += CONV_BK) {
    const int ka = k0 + acol;
    for (int i = 0; i < 4; ++i) {
      const int m = m0 + arow0 + 8 * i;
      float v = 0.0f;
      if (m < s.Og && ka < Kdim) {
        v = float(w[wg + size_t(m) * size_t(Kdim) + size_t(ka)]);
      }
      As[(arow0 + 8 * i) * CONV_BK + acol] = v;
    }
    for (int i = 0; i < 4; ++i) {
      const int kr = brow0 + 4 * i;
      const int k = k0 + kr;
      float v = 0.0f;
      if (jok && k < Kdim) {
        const int c = k / s.KK;
        const int3 r = conv_split3(k - c * s.KK, s.KH, s.KW);
        const int id = id0 + r.x * s.DD;
        const int ih = ih0 + r.y * s.DH;
        const int iw = iw0 + r.z * s.DW;
        if (id >= 0 && id < s.D && ih >= 0 && ih < s.H && iw >= 0 && iw < s.W) {
          v = float(x[xb + size_t(c) * size_t(s.S) + size_t((id * s.H + ih) * s.W + iw)]);
        }
      }
      Bs[kr * CONV_LDB + bcol] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    conv_mma(acc, As, Bs, sm, sn);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  conv_store_acc(acc, Cs, sm, sn);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (jok) {
    for (int i = 0; i < 8; ++i) {
      const int row = brow0 + 4 * i;
      const int m = m0 + row;
      if (m < s.Og) {
        const size_t out = (size_t(bn) * size_t(s.O) + size_t(g * s.Og + m)) * size_t(s.P) + size_t(p);
        y[out] = static_cast<T>(Cs[row * CONV_BN + bcol]);
      }
    }
  }

// @kernel conv2d_dgrad
// @inputs dy, w, params
// @outputs dx
// Template: T. Grid (ceil(N*S / 32) * 128, ceil(Cg / 32), G). dx is [N, C, D, H, W] (the sizes in
// params: for a transposed convolution, its output with output_padding included).
  threadgroup float As[CONV_BM * CONV_BK];
  threadgroup float Bs[CONV_BK * CONV_LDB];
  threadgroup float Cs[CONV_BM * CONV_BN];
  const ConvGeom s = conv_geom(params);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int sm = sg / 2;
  const int sn = sg % 2;
  const int g = int(threadgroup_position_in_grid.z);
  const int m0 = int(threadgroup_position_in_grid.y) * CONV_BM;
  const int n0 = int(threadgroup_position_in_grid.x) * CONV_BN;
  const int Kdim = s.Og * s.KK;
  const int Ncols = s.N * s.S;

  // This thread's B column: one input pixel (n, id, ih, iw); t* = position + padding.
  const int bcol = tid % CONV_BN;
  const int brow0 = tid / CONV_BN;
  const int j = n0 + bcol;
  const bool jok = j < Ncols;
  const int bn = jok ? j / s.S : 0;
  const int q = jok ? j - bn * s.S : 0;
  const int3 iq = conv_split3(q, s.H, s.W);
  const int td = iq.x + s.PD;
  const int th = iq.y + s.PH;
  const int tw = iq.z + s.PW;
  const size_t dyb = (size_t(bn) * size_t(s.O) + size_t(g) * size_t(s.Og)) * size_t(s.P);
  // A[c, (o, r)] = w[g*Og + o, c, r]: this thread's column k = (o, r), rows c = arow0 + 8 * i.
  const int acol = tid % CONV_BK;
  const int arow0 = tid / CONV_BK;
  const size_t wg = size_t(g) * size_t(s.Og) * size_t(s.Cg) * size_t(s.KK);

  simdgroup_float8x8 acc[4];
  conv_zero_acc(acc);
  for (int k0 = 0; k0 < Kdim; k0 += CONV_BK) {
    const int ka = k0 + acol;
    const int ao = ka / s.KK;
    const int ar = ka - ao * s.KK;
    for (int i = 0; i < 4; ++i) {
      const int m = m0 + arow0 + 8 * i;
      float v = 0.0f;
      if (m < s.Cg && ka < Kdim) {
        v = float(w[wg + (size_t(ao) * size_t(s.Cg) + size_t(m)) * size_t(s.KK) + size_t(ar)]);
      }
      As[(arow0 + 8 * i) * CONV_BK + acol] = v;
    }
    for (int i = 0; i < 4; ++i) {
      const int kr = brow0 + 4 * i;
      const int k = k0 + kr;
      float v = 0.0f;
      if (jok && k < Kdim) {
        const int o = k / s.KK;
        const int3 r = conv_split3(k - o * s.KK, s.KH, s.KW);
        // Output pixel whose window puts offset r on this input pixel: (t - r*dil) / stride.
        const int ud = td - r.x * s.DD;
        const int uh = th - r.y * s.DH;
        const int uw = tw - r.z * s.DW;
        if (ud >= 0 && uh >= 0 && uw >= 0 && ud % s.SD == 0 && uh % s.SH == 0 && uw % s.SW == 0) {
          const int od = ud / s.SD;
          const int oh = uh / s.SH;
          const int ow = uw / s.SW;
          if (od < s.OD && oh < s.OH && ow < s.OW) {
            v = float(dy[dyb + size_t(o) * size_t(s.P) + size_t((od * s.OH + oh) * s.OW + ow)]);
          }
        }
      }
      Bs[kr * CONV_LDB + bcol] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    conv_mma(acc, As, Bs, sm, sn);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  conv_store_acc(acc, Cs, sm, sn);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (jok) {
    for (int i = 0; i < 8; ++i) {
      const int row = brow0 + 4 * i;
      const int m = m0 + row;
      if (m < s.Cg) {
        const size_t out = (size_t(bn) * size_t(s.C) + size_t(g * s.Cg + m)) * size_t(s.S) + size_t(q);
        dx[out] = static_cast<T>(Cs[row * CONV_BN + bcol]);
      }
    }
  }

// @kernel conv2d_wgrad
// @inputs dy, x, params
// @outputs dwp
// Template: T. Grid (ceil(Cg*KK / 32) * 128, ceil(Og / 32), G * splits); split z / G sums
// k = (n, p) in [split * KPS, min(N*P, (split + 1) * KPS)) (KPS a multiple of CONV_BK) into the
// float32 partial dwp[split, O, Cg*KK].
  threadgroup float As[CONV_BM * CONV_BK];
  threadgroup float Bs[CONV_BK * CONV_LDB];
  threadgroup float Cs[CONV_BM * CONV_BN];
  const ConvGeom s = conv_geom(params);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int sm = sg / 2;
  const int sn = sg % 2;
  const int z = int(threadgroup_position_in_grid.z);
  const int g = z % s.G;
  const int split = z / s.G;
  const int m0 = int(threadgroup_position_in_grid.y) * CONV_BM;
  const int n0 = int(threadgroup_position_in_grid.x) * CONV_BN;
  const int Ncols = s.Cg * s.KK;
  const int Ktot = s.N * s.P;
  const int kbeg = split * s.KPS;
  const int kend = min(Ktot, kbeg + s.KPS);

  // Loads use k = (n, p) fastest across threads (coalesced reads of dy and x along W): this
  // thread's chunk row kr = tid % 16 is the same for A and B; A rows m = arow0 + 8 * i, B columns
  // jb = arow0 + 8 * i, whose (c, kernel offset) decode is fixed over the loop.
  const int kr = tid % CONV_BK;
  const int arow0 = tid / CONV_BK;
  int bc[4];
  int bd[4];
  int bh[4];
  int bw[4];
  bool bok[4];
  for (int i = 0; i < 4; ++i) {
    const int jb = n0 + arow0 + 8 * i;
    bok[i] = jb < Ncols;
    const int c = bok[i] ? jb / s.KK : 0;
    const int3 r = conv_split3(bok[i] ? jb - c * s.KK : 0, s.KH, s.KW);
    bc[i] = g * s.Cg + c;
    bd[i] = r.x * s.DD - s.PD;
    bh[i] = r.y * s.DH - s.PH;
    bw[i] = r.z * s.DW - s.PW;
  }

  simdgroup_float8x8 acc[4];
  conv_zero_acc(acc);
  for (int k0 = kbeg; k0 < kend; k0 += CONV_BK) {
    const int k = k0 + kr;
    const bool kok = k < kend;
    const int kn = kok ? k / s.P : 0;
    const int kp = kok ? k - kn * s.P : 0;
    const int3 op = conv_split3(kp, s.OH, s.OW);
    const size_t dy_row = size_t(kn) * size_t(s.O) + size_t(g * s.Og);
    for (int i = 0; i < 4; ++i) {
      const int m = m0 + arow0 + 8 * i;
      float v = 0.0f;
      if (kok && m < s.Og) {
        v = float(dy[(dy_row + size_t(m)) * size_t(s.P) + size_t(kp)]);
      }
      As[(arow0 + 8 * i) * CONV_BK + kr] = v;
    }
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
      if (kok && bok[i]) {
        const int id = op.x * s.SD + bd[i];
        const int ih = op.y * s.SH + bh[i];
        const int iw = op.z * s.SW + bw[i];
        if (id >= 0 && id < s.D && ih >= 0 && ih < s.H && iw >= 0 && iw < s.W) {
          v = float(x[(size_t(kn) * size_t(s.C) + size_t(bc[i])) * size_t(s.S) +
                      size_t((id * s.H + ih) * s.W + iw)]);
        }
      }
      Bs[kr * CONV_LDB + arow0 + 8 * i] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    conv_mma(acc, As, Bs, sm, sn);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  conv_store_acc(acc, Cs, sm, sn);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int col = tid % CONV_BN;
  const int jo = n0 + col;
  if (jo < Ncols) {
    for (int i = 0; i < 8; ++i) {
      const int row = tid / CONV_BN + 4 * i;
      const int m = m0 + row;
      if (m < s.Og) {
        const size_t out = (size_t(split) * size_t(s.O) + size_t(g * s.Og + m)) * size_t(Ncols) + size_t(jo);
        dwp[out] = Cs[row * CONV_BN + col];
      }
    }
  }
