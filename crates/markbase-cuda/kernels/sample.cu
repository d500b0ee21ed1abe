// Token choice on the device: greedy argmax, and top-k / top-p sampling with a given uniform
// draw. One block (1024 threads) per row of n logits. NaN counts as −inf. Needs common.cuh.

#define SAMPLE_THREADS 1024

// The better of two (value, index) candidates: larger value, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index); every thread gets it. `sv`, `si` hold 32 entries each.
__device__ void block_best(float& v, int& i, float* sv, int* si) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[w] = v; si[w] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

__device__ __forceinline__ float clean(float x) { return x == x ? x : NEG_INF; }

// Greedy argmax in two passes, so one long row (262 144 logits) spreads over many blocks:
// block (row, p) of `argmax_part` writes the best (value, index) of slice p of the row to
// part[2·(row·parts + p)] (the index as float bits); one warp per row of `argmax_join` picks
// the best of the row's slices into out[row] (ties: lowest index).
extern "C" __global__ void argmax_part(const float* x, int n, int parts, float* part) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    int row = blockIdx.x, p = blockIdx.y;
    const float* r = x + (u64)row * n;
    int span = (n + parts - 1) / parts;
    int lo = p * span, hi = min(n, lo + span);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        float v = clean(r[j]);
        if (better(v, j, bv, bi)) { bv = v; bi = j; }
    }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        u64 o = 2 * ((u64)row * parts + p);
        part[o] = bv;
        part[o + 1] = __int_as_float(bi);
    }
}

extern "C" __global__ void argmax_join(const float* part, int parts, int n, u32* out) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = part + 2 * (u64)blockIdx.x * parts;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        float v = r[2 * p];
        int i = __float_as_int(r[2 * p + 1]);
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = bi < n ? (u32)bi : 0u;
}

// A row's draw: temperature t (0: greedy), top-k (0: off), top-p (1: off), min-p (0: off) and
// the uniform number u in [0, 1), as 5 words (the floats' bits).
#define SAMPLE_DRAW_WORDS 5
// Tokens a rank search gathers, sorts and walks in shared memory (a power of two, at most
// twice the block's threads); smaller in tests, so the narrowing passes run more often.
#ifndef SAMPLE_WINDOW
#define SAMPLE_WINDOW 2048
#endif
// Parts a narrowing pass splits the keys still searched into.
#define SAMPLE_BUCKETS 32

// A token's place in rank order (value descending, then index ascending) as one ascending
// key: the value's bits turned so that larger values give smaller numbers, then the index.
__device__ __forceinline__ u64 rank_key(float s, int j) {
    u32 b = __float_as_uint(s);
    u32 ascending = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)~ascending << 32) | (u32)j;
}

// A token's weight exp(s − m) in units of 2^-40: integer sums, the same in any order, so a
// draw picks the same token however the block adds them. (s = m = ±inf weighs 1.)
__device__ __forceinline__ u64 rank_weight(float s, float m) {
    float d = s - m;
    return (u64)((d == d ? expf(d) : 1.f) * 1099511627776.f);
}

// Shared state of a row's rank searches. A search looks for the first key (rank order) whose
// inclusive prefix — a count of tokens, or their weight — reaches `target`; it narrows the
// keys [lo, hi] a pass at a time (`before_*`: the prefix below lo) until they hold at most
// SAMPLE_WINDOW tokens, then gathers those into the window (sorted keys, inclusive prefix
// weights), which later searches reuse where it holds their target.
struct RankState {
    u64 lo0, hi0;                  // every token's key lies in [lo0, hi0]
    u64 lo, hi, before_cnt, before_mass;
    u64 target;
    u64 key, cnt, mass;            // a search's answer: the key and its inclusive prefix
    u64 win_cnt, win_mass;         // the window's prefix before its first key
    u32 hcnt[32][SAMPLE_BUCKETS];  // a pass's counts and weights: warp by part, then part
    u64 hmass[32][SAMPLE_BUCKETS];
    u64 red[32];
    u64 wkey[SAMPLE_WINDOW];
    u64 wpre[SAMPLE_WINDOW];
    int win_n;                     // tokens in the window (0: none)
    int fill;
    int gather;
};

// Whether the window holds the first key whose prefix reaches st.target.
__device__ __forceinline__ bool window_holds(const RankState& st, bool by_mass) {
    if (st.win_n == 0) return false;
    u64 from = by_mass ? st.win_mass : st.win_cnt;
    u64 to = by_mass ? st.wpre[st.win_n - 1] : st.win_cnt + st.win_n;
    return from < st.target && st.target <= to;
}

// Sets st.key / cnt / mass from the window (window_holds is true); ends with a barrier.
__device__ void window_find(RankState& st, bool by_mass) {
    for (int i = threadIdx.x; i < st.win_n; i += blockDim.x) {
        u64 incl = by_mass ? st.wpre[i] : st.win_cnt + i + 1;
        u64 excl = by_mass ? (i ? st.wpre[i - 1] : st.win_mass) : st.win_cnt + i;
        if (excl < st.target && st.target <= incl) {
            st.key = st.wkey[i];
            st.cnt = st.win_cnt + i + 1;
            st.mass = st.wpre[i];
        }
    }
    __syncthreads();
}

// Gathers the tokens with keys in [st.lo, st.hi] (at most SAMPLE_WINDOW, st.before_* below
// them) into the window, sorted, with inclusive prefix weights; ends with a barrier.
__device__ void rank_gather(RankState& st, const float* r, int n, float inv_t, float m) {
    if (threadIdx.x == 0) st.fill = 0;
    __syncthreads();
    const u64 lo = st.lo, hi = st.hi;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float v = r[j];
        if (v != v) continue;
        float s = v * inv_t;
        u64 k = rank_key(s, j);
        if (k < lo || k > hi) continue;
        int at = atomicAdd(&st.fill, 1);
        st.wkey[at] = k;
        st.wpre[at] = rank_weight(s, m);
    }
    __syncthreads();
    const int count = st.fill;
    int size = 1;
    while (size < count) size <<= 1;
    for (int i = count + threadIdx.x; i < size; i += blockDim.x) {
        st.wkey[i] = ~0ull;
        st.wpre[i] = 0;
    }
    __syncthreads();
    // Bitonic sort by key (keys are distinct: each holds its token's index).
    for (int k = 2; k <= size; k <<= 1) {
        for (int h = k >> 1; h > 0; h >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                int o = i ^ h;
                if (o > i && ((st.wkey[i] > st.wkey[o]) == ((i & k) == 0))) {
                    u64 tk = st.wkey[i], tm = st.wpre[i];
                    st.wkey[i] = st.wkey[o];
                    st.wpre[i] = st.wpre[o];
                    st.wkey[o] = tk;
                    st.wpre[o] = tm;
                }
            }
            __syncthreads();
        }
    }
    // Inclusive prefix weights: each thread adds a run of consecutive entries.
    const int per = (size + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
    u64 mine = 0;
    for (int q = 0; q < per && first + q < size; q++) mine += st.wpre[first + q];
    u64 all;
    u64 run = st.before_mass + block_exclusive_scan(mine, st.red, &all);
    for (int q = 0; q < per && first + q < size; q++) {
        run += st.wpre[first + q];
        st.wpre[first + q] = run;
    }
    if (threadIdx.x == 0) {
        st.win_n = count;
        st.win_cnt = st.before_cnt;
        st.win_mass = st.before_mass;
    }
    __syncthreads();
}

// The first key (rank order) whose inclusive prefix count (by_mass false) or weight reaches
// st.target — or, with frac > 0, ceil(frac × the row's weight), found by the first pass —
// into st.key / cnt / mass. Each pass splits the keys still searched into SAMPLE_BUCKETS parts
// of equal width and keeps the part the prefix reaches the target in, until that part fits
// the window. All threads call it; it ends with a barrier.
__device__ void rank_search(RankState& st, const float* r, int n, float inv_t, float m,
                            bool by_mass, float frac) {
    __syncthreads();
    if (frac == 0.f && window_holds(st, by_mass)) {
        window_find(st, by_mass);
        return;
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        st.lo = st.lo0;
        st.hi = st.hi0;
        st.before_cnt = 0;
        st.before_mass = 0;
    }
    __syncthreads();
    for (bool first = true;; first = false) {
        const u64 lo = st.lo, hi = st.hi, span = hi - lo;
        // (span >> shift) < SAMPLE_BUCKETS.
        const int shift = span >> 5 ? 64 - __clzll(span) - 5 : 0;
        u32 cnt[SAMPLE_BUCKETS];
        u64 mass[SAMPLE_BUCKETS];
        for (int b = 0; b < SAMPLE_BUCKETS; b++) {
            cnt[b] = 0;
            mass[b] = 0;
        }
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = r[j];
            if (v != v) continue;
            float s = v * inv_t;
            u64 k = rank_key(s, j);
            if (k < lo || k > hi) continue;
            int b = (int)((k - lo) >> shift);
            cnt[b]++;
            mass[b] += rank_weight(s, m);
        }
        for (int b = 0; b < SAMPLE_BUCKETS; b++) {
            u32 c = cnt[b];
            u64 ms = mass[b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                c += __shfl_xor_sync(0xffffffffu, c, o);
                ms += __shfl_xor_sync(0xffffffffu, ms, o);
            }
            if (lane == 0) {
                st.hcnt[w][b] = c;
                st.hmass[w][b] = ms;
            }
        }
        __syncthreads();
        if (threadIdx.x < SAMPLE_BUCKETS) {
            const int b = threadIdx.x;
            u32 c = 0;
            u64 ms = 0;
            for (int i = 0; i < nw; i++) {
                c += st.hcnt[i][b];
                ms += st.hmass[i][b];
            }
            st.hcnt[0][b] = c;
            st.hmass[0][b] = ms;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            if (first && frac > 0.f) {
                u64 total = 0;
                for (int b = 0; b < SAMPLE_BUCKETS; b++) total += st.hmass[0][b];
                u64 t = (u64)ceil((double)frac * (double)total);
                st.target = t ? t : 1;
            }
            // The part the prefix reaches the target in; past the end (rounding), the last
            // part that holds a token.
            u64 run = by_mass ? st.before_mass : st.before_cnt;
            int part = -1, last = 0;
            for (int b = 0; b < SAMPLE_BUCKETS; b++) {
                if (st.hcnt[0][b]) last = b;
                u64 add = by_mass ? st.hmass[0][b] : st.hcnt[0][b];
                if (part < 0 && run + add >= st.target && st.hcnt[0][b]) part = b;
                run += add;
            }
            if (part < 0) part = last;
            for (int b = 0; b < part; b++) {
                st.before_cnt += st.hcnt[0][b];
                st.before_mass += st.hmass[0][b];
            }
            const u64 from = lo + ((u64)part << shift);
            u64 to = from + ((1ull << shift) - 1);
            if (to < from || to > hi) to = hi;
            st.lo = from;
            st.hi = to;
            st.gather = st.hcnt[0][part] <= SAMPLE_WINDOW;
        }
        __syncthreads();
        if (st.gather) break;
    }
    rank_gather(st, r, n, inv_t, m);
    if (st.win_n > 0 && !window_holds(st, by_mass)) {
        // The target lies past every token (rounding): the window's last token answers.
        if (threadIdx.x == 0) st.target = by_mass ? st.wpre[st.win_n - 1] : st.win_cnt + st.win_n;
        __syncthreads();
    }
    window_find(st, by_mass);
}

// The token each row of n logits picks under its draw (markbase_core::sampling::pick): one
// block of 1 024 threads a row, s = logit / t, NaN never kept.
// - t = 0: the argmax (ties: the lowest index).
// - No top-k (or k at least the row's tokens) and no top-p: every token in index order,
//   e = exp(s − max), those under min-p (e < min_p) dropped; the token where u · Σe falls in
//   the running sum. Each thread sums a contiguous slice; the slice that holds u · Σe walks
//   its values.
// - Otherwise in rank order (value desc, index asc), as the host: the k best; of them the
//   shortest prefix whose weight reaches top-p of theirs; of those the ones at or above
//   min-p × the best; the token where u · their weight falls. Each limit is a rank search
//   (rank_search) over integer weights (2^-40 units), and the kept prefix ends at the
//   shortest.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_rows(const float* x, int n, const u32* draws, u32* out) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int tail;
    __shared__ RankState st;
    const float* r = x + (u64)blockIdx.x * n;
    const u32* d = draws + SAMPLE_DRAW_WORDS * blockIdx.x;
    const float t = __uint_as_float(d[0]), top_p = __uint_as_float(d[2]);
    const float min_p = __uint_as_float(d[3]), u = __uint_as_float(d[4]);
    const int top_k = (int)d[1];
    if (t == 0.f) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = clean(r[j]);
            if (better(v, j, bv, bi)) { bv = v; bi = j; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) out[blockIdx.x] = bi < n ? (u32)bi : 0u;
        return;
    }
    const float inv_t = 1.f / t;
    // The largest and smallest s and the tokens that are not NaN.
    float mx = NEG_INF, lo_v = -NEG_INF;
    int mi = 0x7fffffff, valid = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float v = r[j];
        if (v != v) continue;
        float s = v * inv_t;
        if (better(s, j, mx, mi)) { mx = s; mi = j; }
        lo_v = fminf(lo_v, s);
        valid++;
    }
    block_best(mx, mi, sv, si);
    float neg_lo = -lo_v;
    int unused = 0;
    block_best(neg_lo, unused, sv, si);
    int n_valid;
    block_exclusive_scan(valid, si, &n_valid);
    if (n_valid == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }
    const bool whole = top_k == 0 || top_k >= n_valid;
    if (whole && top_p >= 1.f) {
        const int per = (n + blockDim.x - 1) / blockDim.x;
        const int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
        float mine = 0.f;
        for (int j = lo; j < hi; j++) {
            float e = expf(clean(r[j]) * inv_t - mx);
            if (e >= min_p) mine += e;
        }
        float total;
        const float before = block_exclusive_scan(mine, sv, &total);
        const float target = u * total;
        // The slice holding the target walks its values to it. Rounding may put the target
        // at a slice's edge: every slice starting at or below it walks, the lowest pick wins,
        // and where none reached it the last slice starting at or below it gives its last
        // kept token.
        const bool walks = mine > 0.f && before <= target;
        float fv = NEG_INF;
        int fi = 0x7fffffff, last = -1;
        if (walks) {
            float run = 0.f, want = target - before;
            for (int j = lo; j < hi; j++) {
                float e = expf(clean(r[j]) * inv_t - mx);
                if (e < min_p || e == 0.f) continue;
                run += e;
                last = j;
                if (want < run) { fv = 1.f; fi = j; break; }
            }
        }
        block_best(fv, fi, sv, si);
        if (fv > 0.f) {
            if (threadIdx.x == 0) out[blockIdx.x] = (u32)fi;
            return;
        }
        float tv = walks ? 1.f : NEG_INF;
        int ti = blockDim.x - 1 - threadIdx.x;
        block_best(tv, ti, sv, si);
        if (tv > 0.f && threadIdx.x == blockDim.x - 1 - ti) tail = last;
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = tv > 0.f ? (u32)tail : (u32)mi;
        return;
    }
    if (threadIdx.x == 0) {
        st.lo0 = rank_key(mx, 0);
        st.hi0 = rank_key(-neg_lo, 0x7fffffff);
        st.win_n = 0;
    }
    // The kept prefix: its last key, its tokens and their weight.
    u64 end_key = ~0ull, end_cnt = 0, end_mass = 0;
    if (!whole) {
        if (threadIdx.x == 0) st.target = (u64)top_k;
        rank_search(st, r, n, inv_t, mx, false, 0.f);
        end_key = st.key;
        end_cnt = st.cnt;
        end_mass = st.mass;
    }
    if (top_p < 1.f) {
        if (!whole) {
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 t = (u64)ceil((double)top_p * (double)end_mass);
                st.target = t ? t : 1;
            }
        }
        rank_search(st, r, n, inv_t, mx, true, whole ? top_p : 0.f);
        end_key = st.key;
        end_cnt = st.cnt;
        end_mass = st.mass;
    }
    if (min_p > 0.f) {
        // Tokens at or above min-p × the best (weight ≥ min_p) are a prefix of rank order:
        // where it is shorter, it ends the kept prefix.
        u64 last = 0, cnt = 0, mass = 0;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = r[j];
            if (v != v) continue;
            float s = v * inv_t, dd = s - mx;
            if ((dd == dd ? expf(dd) : 1.f) < min_p) continue;
            u64 k = rank_key(s, j);
            last = k > last ? k : last;
            cnt++;
            mass += rank_weight(s, mx);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            u64 ol = __shfl_xor_sync(0xffffffffu, last, o);
            last = ol > last ? ol : last;
        }
        __syncthreads();
        if ((threadIdx.x & 31) == 0) st.red[threadIdx.x >> 5] = last;
        __syncthreads();
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) last = st.red[i] > last ? st.red[i] : last;
        u64 all_cnt, all_mass;
        block_exclusive_scan(cnt, st.red, &all_cnt);
        block_exclusive_scan(mass, st.red, &all_mass);
        if (last < end_key) {
            end_key = last;
            end_cnt = all_cnt;
            end_mass = all_mass;
        }
    }
    // The walk: the first key whose prefix weight passes u × the kept weight. A kept prefix
    // that fits the window is gathered whole when the window does not hold the target.
    __syncthreads();
    if (threadIdx.x == 0) st.target = (u64)((double)u * (double)end_mass) + 1;
    __syncthreads();
    if (!window_holds(st, true) && end_cnt <= SAMPLE_WINDOW) {
        if (threadIdx.x == 0) {
            st.lo = st.lo0;
            st.hi = end_key;
            st.before_cnt = 0;
            st.before_mass = 0;
        }
        __syncthreads();
        rank_gather(st, r, n, inv_t, mx);
    }
    rank_search(st, r, n, inv_t, mx, true, 0.f);
    if (threadIdx.x == 0) {
        u32 pick = (u32)(st.key & 0xffffffffu);
        out[blockIdx.x] = pick < (u32)n ? pick : 0u;
    }
}
