// Token choice on the device: greedy argmax over many blocks a row (argmax_part, argmax_join),
// and every draw of markbase_core::sampling::pick (sample_rows: a row's blocks share its
// passes and meet at barriers). Needs common.cuh. Shared memory is dynamic throughout, so the
// CPU emulator can run a row's blocks at once.

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
// the best of the row's slices into out[row] (ties: lowest index). Both take 256 bytes of
// dynamic shared memory.
extern "C" __global__ void argmax_part(const float* x, int n, int parts, float* part) {
    wait_prior_grid();
    extern __shared__ u64 argmax_smem[];
    float* sv = (float*)argmax_smem;
    int* si = (int*)(sv + 32);
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
    extern __shared__ u64 argmax_smem[];
    float* sv = (float*)argmax_smem;
    int* si = (int*)(sv + 32);
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
#define SAMPLE_BUCKETS 256
// Blocks a row is spread over, at most.
#define SAMPLE_MAX_PARTS 256
// A row's scratch in global memory, in 64-bit words; sample_reset zeroes the first
// SAMPLE_ZEROED before each launch.
#define SAMPLE_BAR 0                                        // arrivals at the row's barriers
#define SAMPLE_FILL 1                                       // 7 gathers' token counts
#define SAMPLE_HIST 8                                       // 3 histograms: counts, weights
#define SAMPLE_ZEROED (SAMPLE_HIST + 6 * SAMPLE_BUCKETS)
#define SAMPLE_PART SAMPLE_ZEROED                           // 8 words a block
#define SAMPLE_GATHER (SAMPLE_PART + 8 * SAMPLE_MAX_PARTS)  // 2 areas: keys, then weights
#define SAMPLE_ROW_WORDS (SAMPLE_GATHER + 4 * SAMPLE_WINDOW)
// A block's words in SAMPLE_PART: its best s and that token, its least s, its tokens that are
// not NaN; its kept weight over every token; the last key at or above min-p, such tokens and
// their weight.
#define PART_MAX 0
#define PART_MAX_AT 1
#define PART_MIN 2
#define PART_VALID 3
#define PART_WEIGHT 4
#define PART_MIN_P_LAST 5
#define PART_MIN_P_COUNT 6
#define PART_MIN_P_WEIGHT 7
// Dynamic shared memory of a sample_rows block (the backend passes this many bytes).
#define SAMPLE_SHARED_BYTES 40960

// Zeroes the first SAMPLE_ZEROED words of each row's scratch (one block a row).
extern "C" __global__ void sample_reset(u64* scratch) {
    wait_prior_grid();
    u64* rs = scratch + (u64)blockIdx.x * SAMPLE_ROW_WORDS;
    for (int i = threadIdx.x; i < SAMPLE_ZEROED; i += blockDim.x) rs[i] = 0;
}

// *p as another block wrote it (from L2, not a stale L1 line).
__device__ __forceinline__ u64 ld_row_word(const u64* p) {
#ifdef MB_EMU
    return *(const volatile u64*)p;
#else
    u64 v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#endif
}

// A token's place in rank order (value descending, then index ascending) as one ascending
// key: the value's bits turned so that larger values give smaller numbers, then the index.
__device__ __forceinline__ u64 rank_key(float s, int j) {
    u32 b = __float_as_uint(s);
    u32 ascending = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)~ascending << 32) | (u32)j;
}

// exp(s − m), the weight of a token against the row's best (s = m = ±inf weighs 1).
__device__ __forceinline__ float rank_e(float s, float m) {
    float d = s - m;
    return d == d ? __expf(d) : 1.f;
}

// e in units of 2^-40: integer sums, the same in any order, so a draw picks the same token
// however the blocks and threads add them.
__device__ __forceinline__ u64 fixed_weight(float e) { return (u64)(e * 1099511627776.f); }

// The weight logit v keeps in a draw over every token: 0 for NaN and under min-p.
__device__ __forceinline__ u64 kept_weight(float v, float inv_t, float m, float min_p) {
    if (v != v) return 0;
    float e = rank_e(v * inv_t, m);
    return e < min_p ? 0 : fixed_weight(e);
}

// A sample_rows block's shared memory: reduction slots, its share of a pass's histogram, the
// window (the tokens a search gathered: keys sorted, inclusive prefix weights) and the row's
// search state, the same in every block of the row (each decides from the same sums).
struct SampleShared {
    float sv[32];
    int si[32];
    u64 red[32];
    u32 hcnt[SAMPLE_BUCKETS];
    u64 hw[SAMPLE_BUCKETS];
    u32 first_cnt[SAMPLE_BUCKETS];  // the first pass over every key, kept for later searches
    u64 first_w[SAMPLE_BUCKETS];
    u64 wkey[SAMPLE_WINDOW];
    u64 wpre[SAMPLE_WINDOW];
    u64 lo0, hi0;                  // every token's key lies in [lo0, hi0]
    u64 lo, hi, before_cnt, before_mass;
    u64 target;
    u64 key, cnt, mass;            // a search's answer: the key and its inclusive prefix
    u64 win_cnt, win_mass;         // the window's prefix before its first key
    u64 total;                     // a row-wide sum (the combine steps)
    float mx, lo_v;                // the row's largest and smallest s
    int mi, n_valid;               // the largest's token; tokens that are not NaN
    int win_n;                     // tokens in the window (0: none)
    int gather;                    // the part a pass kept fits the window
    int have_first;                // first_cnt / first_w hold the first pass
    u32 gen, passes, gathers;      // barriers, histogram passes and gathers so far
};
static_assert(sizeof(SampleShared) <= SAMPLE_SHARED_BYTES, "SAMPLE_SHARED_BYTES too small");

// One row of sample_rows: its logits, scratch and geometry, this block's chunk [c0, c1).
struct SampleRow {
    const float* r;
    u64* rs;
    int parts, part, c0, c1;
    float inv_t;
    u32* err;
};

// Waits until every block of the row has arrived here (its sh.gen-th barrier): what each
// wrote before is then visible to all (read with ld_row_word). A wait past one second
// (the row's blocks were not all resident) raises MB_ERR_SAMPLE_STALL and goes on.
__device__ void row_barrier(const SampleRow& w, SampleShared& sh) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 want = (u64)w.parts * ++sh.gen;
        __threadfence();
        atomicAdd((unsigned long long*)(w.rs + SAMPLE_BAR), 1ull);
#ifdef MB_EMU
        while (ld_row_word(w.rs + SAMPLE_BAR) < want) mb_emu::spin();
#else
        u64 start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        while (ld_row_word(w.rs + SAMPLE_BAR) < want) {
            asm volatile("nanosleep.u32 32;");
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > 1000000000ull) {
                atomicOr(w.err, (u32)MB_ERR_SAMPLE_STALL);
                break;
            }
        }
#endif
        __threadfence();
    }
    __syncthreads();
}

// Word `slot` of block q's part words in thread q (0 past the row's blocks).
__device__ __forceinline__ u64 part_word(const SampleRow& w, int slot) {
    return (int)threadIdx.x < w.parts ? ld_row_word(w.rs + SAMPLE_PART + 8 * threadIdx.x + slot)
                                      : 0;
}

// Word `slot` of the row's blocks' part words (written before the last barrier) summed: every
// block gets the sum; `ahead` gets that of the blocks before this one.
__device__ u64 row_total(const SampleRow& w, SampleShared& sh, int slot, u64* ahead) {
    u64 x = part_word(w, slot);
    u64 all;
    const u64 before = block_exclusive_scan(x, sh.red, &all);
    if ((int)threadIdx.x == w.part) sh.total = before;
    __syncthreads();
    *ahead = sh.total;
    __syncthreads();
    return all;
}

// The block's `v` in word `slot` of its part words, summed over the row's blocks (row_total).
__device__ u64 row_sum(const SampleRow& w, SampleShared& sh, u64 v, int slot, u64* ahead) {
    if (threadIdx.x == 0) w.rs[SAMPLE_PART + 8 * w.part + slot] = v;
    row_barrier(w, sh);
    return row_total(w, sh, slot, ahead);
}

// The largest `v` of the block (every thread gets it).
__device__ u64 block_max_u64(u64 v, u64* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) v = red[i] > v ? red[i] : v;
    __syncthreads();
    return v;
}

// Whether the window holds the first key whose prefix reaches sh.target.
__device__ __forceinline__ bool window_holds(const SampleShared& sh, bool by_mass) {
    if (sh.win_n == 0) return false;
    u64 from = by_mass ? sh.win_mass : sh.win_cnt;
    u64 to = by_mass ? sh.wpre[sh.win_n - 1] : sh.win_cnt + sh.win_n;
    return from < sh.target && sh.target <= to;
}

// Sets sh.key / cnt / mass from the window (window_holds is true); ends with a barrier.
__device__ void window_find(SampleShared& sh, bool by_mass) {
    for (int i = threadIdx.x; i < sh.win_n; i += blockDim.x) {
        u64 incl = by_mass ? sh.wpre[i] : sh.win_cnt + i + 1;
        u64 excl = by_mass ? (i ? sh.wpre[i - 1] : sh.win_mass) : sh.win_cnt + i;
        if (excl < sh.target && sh.target <= incl) {
            sh.key = sh.wkey[i];
            sh.cnt = sh.win_cnt + i + 1;
            sh.mass = sh.wpre[i];
        }
    }
    __syncthreads();
}

// Gathers the row's tokens with keys in [sh.lo, sh.hi] (at most SAMPLE_WINDOW, sh.before_*
// ahead of them) into every block's window, sorted, with inclusive prefix weights. The
// blocks write them to one of two areas (gathers alternate), meet, and each reads them all.
__device__ void rank_gather(const SampleRow& w, SampleShared& sh) {
    const u64 lo = sh.lo, hi = sh.hi;
    const u32 g = sh.gathers;
    u64* fill = w.rs + SAMPLE_FILL + g;
    u64* keys = w.rs + SAMPLE_GATHER + (g & 1) * 2 * SAMPLE_WINDOW;
    u64* weights = keys + SAMPLE_WINDOW;
    for (int j = w.c0 + threadIdx.x; j < w.c1; j += blockDim.x) {
        float v = w.r[j];
        if (v != v) continue;
        float s = v * w.inv_t;
        u64 k = rank_key(s, j);
        if (k < lo || k > hi) continue;
        u64 at = atomicAdd((unsigned long long*)fill, 1ull);
        if (at < SAMPLE_WINDOW) {
            keys[at] = k;
            weights[at] = fixed_weight(rank_e(s, sh.mx));
        }
    }
    row_barrier(w, sh);
    const int count = (int)min(ld_row_word(fill), (u64)SAMPLE_WINDOW);
    int size = 1;
    while (size < count) size <<= 1;
    for (int i = threadIdx.x; i < size; i += blockDim.x) {
        sh.wkey[i] = i < count ? ld_row_word(keys + i) : ~0ull;
        sh.wpre[i] = i < count ? ld_row_word(weights + i) : 0;
    }
    __syncthreads();
    // Bitonic sort by key (keys are distinct: each holds its token's index).
    for (int k = 2; k <= size; k <<= 1) {
        for (int h = k >> 1; h > 0; h >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                int o = i ^ h;
                if (o > i && ((sh.wkey[i] > sh.wkey[o]) == ((i & k) == 0))) {
                    u64 tk = sh.wkey[i], tm = sh.wpre[i];
                    sh.wkey[i] = sh.wkey[o];
                    sh.wpre[i] = sh.wpre[o];
                    sh.wkey[o] = tk;
                    sh.wpre[o] = tm;
                }
            }
            __syncthreads();
        }
    }
    // Inclusive prefix weights: each thread adds a run of consecutive entries.
    const int per = (size + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
    u64 mine = 0;
    for (int q = 0; q < per && first + q < size; q++) mine += sh.wpre[first + q];
    u64 all;
    u64 run = sh.before_mass + block_exclusive_scan(mine, sh.red, &all);
    for (int q = 0; q < per && first + q < size; q++) {
        run += sh.wpre[first + q];
        sh.wpre[first + q] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.win_n = count;
        sh.win_cnt = sh.before_cnt;
        sh.win_mass = sh.before_mass;
        sh.gathers = g + 1;
    }
    __syncthreads();
}

// One narrowing pass: the row's tokens with keys in [sh.lo, sh.hi] counted and weighed in
// SAMPLE_BUCKETS parts of width 2^shift (each block adds its chunk's into the pass's global
// histogram, one of three in turn), then the row's histogram in sh.hcnt / sh.hw of every
// block. After the barrier the first block zeroes the histogram the pass after next adds
// into (the one every block read after the last barrier).
__device__ void rank_pass(const SampleRow& w, SampleShared& sh, int shift) {
    const u64 lo = sh.lo, hi = sh.hi;
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
        sh.hcnt[b] = 0;
        sh.hw[b] = 0;
    }
    __syncthreads();
    // A warp's tokens in one part add once (a warp sum), not a shared atomic each: the
    // busiest parts hold most of a pass's tokens.
    const int lane = threadIdx.x & 31;
    for (int j0 = w.c0 + (threadIdx.x & ~31); j0 < w.c1; j0 += blockDim.x) {
        const int j = j0 + lane;
        int b = -1;
        u64 weight = 0;
        if (j < w.c1) {
            float v = w.r[j];
            float s = v * w.inv_t;
            u64 k = rank_key(s, j);
            if (v == v && k >= lo && k <= hi) {
                b = (int)((k - lo) >> shift);
                weight = fixed_weight(rank_e(s, sh.mx));
            }
        }
        if (__ballot_sync(0xffffffffu, b >= 0) == 0) continue;  // none of the warp's is searched
        const unsigned peers = __match_any_sync(0xffffffffu, b);
        if (b >= 0 && __popc(peers) == 1) {
            atomicAdd(&sh.hcnt[b], 1u);
            atomicAdd((unsigned long long*)&sh.hw[b], (unsigned long long)weight);
        }
        unsigned shared_parts = __ballot_sync(0xffffffffu, b >= 0 && __popc(peers) > 1);
        while (shared_parts) {
            const int first = __ffs(shared_parts) - 1;
            const unsigned group = __shfl_sync(0xffffffffu, peers, first);
            u64 sum = (group >> lane) & 1 ? weight : 0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == first) {
                atomicAdd(&sh.hcnt[b], (u32)__popc(group));
                atomicAdd((unsigned long long*)&sh.hw[b], (unsigned long long)sum);
            }
            shared_parts &= ~group;
        }
    }
    __syncthreads();
    const u32 buf = sh.passes % 3;
    u64* hist = w.rs + SAMPLE_HIST + buf * 2 * SAMPLE_BUCKETS;
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
        if (sh.hcnt[b]) {
            atomicAdd((unsigned long long*)(hist + b), (unsigned long long)sh.hcnt[b]);
            atomicAdd((unsigned long long*)(hist + SAMPLE_BUCKETS + b), (unsigned long long)sh.hw[b]);
        }
    }
    row_barrier(w, sh);
    u64* later = w.rs + SAMPLE_HIST + ((buf + 2) % 3) * 2 * SAMPLE_BUCKETS;
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
        if (w.part == 0) {
            later[b] = 0;
            later[SAMPLE_BUCKETS + b] = 0;
        }
        sh.hcnt[b] = (u32)ld_row_word(hist + b);
        sh.hw[b] = ld_row_word(hist + SAMPLE_BUCKETS + b);
    }
    __syncthreads();
    if (threadIdx.x == 0) sh.passes++;
}

// The first key (rank order) whose inclusive prefix count (by_mass false) or weight reaches
// sh.target — or, with frac > 0, ceil(frac × the row's weight), found by the first pass —
// into sh.key / cnt / mass. Each pass keeps the part of the keys still searched that the
// prefix reaches the target in, until that part fits the window. Every block of the row
// calls it; it ends with a barrier of the block.
__device__ void rank_search(const SampleRow& w, SampleShared& sh, bool by_mass, float frac) {
    __syncthreads();
    if (frac == 0.f && window_holds(sh, by_mass)) {
        window_find(sh, by_mass);
        return;
    }
    if (threadIdx.x == 0) {
        sh.lo = sh.lo0;
        sh.hi = sh.hi0;
        sh.before_cnt = 0;
        sh.before_mass = 0;
    }
    __syncthreads();
    for (bool first = true;; first = false) {
        const u64 lo = sh.lo, hi = sh.hi, span = hi - lo;
        const int bits = span ? 64 - __clzll(span) : 0;
        const int shift = bits > 8 ? bits - 8 : 0;  // (span >> shift) < SAMPLE_BUCKETS
        if (first && sh.have_first) {
            // Every search's first pass covers every key: the row's first one holds its sums.
            for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
                sh.hcnt[b] = sh.first_cnt[b];
                sh.hw[b] = sh.first_w[b];
            }
        } else {
            rank_pass(w, sh, shift);
            if (first) {
                for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
                    sh.first_cnt[b] = sh.hcnt[b];
                    sh.first_w[b] = sh.hw[b];
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) sh.have_first = 1;
        if (threadIdx.x == 0) {
            if (first && frac > 0.f) {
                u64 total = 0;
                for (int b = 0; b < SAMPLE_BUCKETS; b++) total += sh.hw[b];
                u64 t = (u64)ceil((double)frac * (double)total);
                sh.target = t ? t : 1;
            }
            // The part the prefix reaches the target in; past the end (rounding), the last
            // part that holds a token.
            u64 run = by_mass ? sh.before_mass : sh.before_cnt;
            int part = -1, last = 0;
            for (int b = 0; b < SAMPLE_BUCKETS; b++) {
                if (sh.hcnt[b]) last = b;
                u64 add = by_mass ? sh.hw[b] : sh.hcnt[b];
                if (part < 0 && run + add >= sh.target && sh.hcnt[b]) part = b;
                run += add;
            }
            if (part < 0) part = last;
            for (int b = 0; b < part; b++) {
                sh.before_cnt += sh.hcnt[b];
                sh.before_mass += sh.hw[b];
            }
            const u64 from = lo + ((u64)part << shift);
            u64 to = from + ((1ull << shift) - 1);
            if (to < from || to > hi) to = hi;
            sh.lo = from;
            sh.hi = to;
            // A part of single keys holds one token at most: the search ends in 8 passes.
            sh.gather = sh.hcnt[part] <= SAMPLE_WINDOW || shift == 0;
        }
        __syncthreads();
        if (sh.gather) break;
    }
    rank_gather(w, sh);
    const bool past = sh.win_n > 0 && !window_holds(sh, by_mass);
    __syncthreads();
    if (past) {
        // The target lies past every token (rounding): the window's last token answers.
        if (threadIdx.x == 0) sh.target = by_mass ? sh.wpre[sh.win_n - 1] : sh.win_cnt + sh.win_n;
        __syncthreads();
    }
    window_find(sh, by_mass);
}

// The token each row of n logits picks under its draw (markbase_core::sampling::pick), s =
// logit / t, NaN never kept. Grid (parts, rows), SAMPLE_THREADS threads and
// SAMPLE_SHARED_BYTES of dynamic shared memory a block; block (p, row) takes chunk p of the
// row, and the row's blocks meet at barriers in `scratch` (SAMPLE_ROW_WORDS words a row,
// sample_reset first), so they must all be resident at once (the backend keeps rows × parts
// within one block a multiprocessor; a wait past a second raises MB_ERR_SAMPLE_STALL in err).
// - The row's best s (ties: the lowest index), its least, and its tokens that are not NaN.
// - t = 0: the best (the argmax).
// - No top-k (or k at least the row's tokens) and no top-p: every token in index order, with
//   weight e = exp(s − best) in 2^-40 units (0 under min-p); the token where the running sum
//   first reaches ⌊u · Σ⌋ + 1.
// - Otherwise in rank order (value desc, index asc), as the host: the k best; of them the
//   shortest prefix whose weight reaches top-p of theirs; of those the ones at or above
//   min-p × the best; the token where the running weight first reaches ⌊u · theirs⌋ + 1. Each
//   limit is a rank search (rank_search), and the kept prefix ends at the shortest.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_rows(const float* x, int n, const u32* draws, u32* out, u64* scratch, int parts,
                u32* err) {
    wait_prior_grid();
    extern __shared__ u64 sample_smem[];
    SampleShared& sh = *(SampleShared*)sample_smem;
    const int row = blockIdx.y;
    const u32* d = draws + SAMPLE_DRAW_WORDS * row;
    const float t = __uint_as_float(d[0]), top_p = __uint_as_float(d[2]);
    const float min_p = __uint_as_float(d[3]), u = __uint_as_float(d[4]);
    const int top_k = (int)d[1];
    const int span = (n + parts - 1) / parts;
    SampleRow w;
    w.r = x + (u64)row * n;
    w.rs = scratch + (u64)row * SAMPLE_ROW_WORDS;
    w.parts = parts;
    w.part = blockIdx.x;
    w.c0 = min(n, (int)blockIdx.x * span);
    w.c1 = min(n, w.c0 + span);
    w.inv_t = t > 0.f ? 1.f / t : 1.f;
    w.err = err;
    if (threadIdx.x == 0) {
        sh.gen = 0;
        sh.passes = 0;
        sh.gathers = 0;
        sh.win_n = 0;
        sh.have_first = 0;
    }
    // The best and least s, and the tokens that are not NaN, of the chunk, then of the row.
    float mx = NEG_INF, lo_v = -NEG_INF;
    int mi = 0x7fffffff, valid = 0;
    for (int j = w.c0 + threadIdx.x; j < w.c1; j += blockDim.x) {
        float v = w.r[j];
        if (v != v) continue;
        float s = v * w.inv_t;
        if (better(s, j, mx, mi)) { mx = s; mi = j; }
        lo_v = fminf(lo_v, s);
        valid++;
    }
    block_best(mx, mi, sh.sv, sh.si);
    float neg_lo = -lo_v;
    int unused = 0;
    block_best(neg_lo, unused, sh.sv, sh.si);
    int chunk_valid;
    block_exclusive_scan(valid, sh.si, &chunk_valid);
    if (threadIdx.x == 0) {
        u64* mine = w.rs + SAMPLE_PART + 8 * w.part;
        mine[PART_MAX] = __float_as_uint(mx);
        mine[PART_MAX_AT] = (u32)mi;
        mine[PART_MIN] = __float_as_uint(-neg_lo);
        mine[PART_VALID] = (u64)chunk_valid;
    }
    row_barrier(w, sh);
    {
        // Block q's words in thread q: the row's best, least and count.
        float bv = NEG_INF, neg_least = NEG_INF;
        int bi = 0x7fffffff, chunk = 0, ignored = 0;
        if ((int)threadIdx.x < parts) {
            const u64* o = w.rs + SAMPLE_PART + 8 * threadIdx.x;
            bv = __uint_as_float((u32)ld_row_word(o + PART_MAX));
            bi = (int)(u32)ld_row_word(o + PART_MAX_AT);
            neg_least = -__uint_as_float((u32)ld_row_word(o + PART_MIN));
            chunk = (int)ld_row_word(o + PART_VALID);
        }
        block_best(bv, bi, sh.sv, sh.si);
        block_best(neg_least, ignored, sh.sv, sh.si);
        int all;
        block_exclusive_scan(chunk, sh.si, &all);
        if (threadIdx.x == 0) {
            sh.mx = bv;
            sh.mi = bi;
            sh.lo_v = -neg_least;
            sh.n_valid = all;
        }
    }
    __syncthreads();
    const bool first_block = w.part == 0 && threadIdx.x == 0;
    if (t == 0.f || sh.n_valid == 0 || !(sh.mx > NEG_INF)) {
        // The argmax (a row of NaN and -inf: token 0, as the host's).
        if (first_block) out[row] = sh.mx > NEG_INF && sh.mi < n ? (u32)sh.mi : 0u;
        return;
    }
    const bool whole = top_k == 0 || top_k >= sh.n_valid;
    if (whole && top_p >= 1.f) {
        // Each thread weighs a contiguous run of the chunk; the run where the row's running
        // sum reaches the target walks its tokens.
        const int len = w.c1 - w.c0, per = (len + blockDim.x - 1) / blockDim.x;
        const int a = min(w.c1, w.c0 + (int)threadIdx.x * per), b = min(w.c1, a + per);
        u64 mine = 0;
        for (int j = a; j < b; j++) mine += kept_weight(w.r[j], w.inv_t, sh.mx, min_p);
        u64 chunk_total;
        const u64 within = block_exclusive_scan(mine, sh.red, &chunk_total);
        u64 ahead;
        const u64 total = row_sum(w, sh, chunk_total, PART_WEIGHT, &ahead);
        const u64 target = (u64)((double)u * (double)total) + 1;
        u64 run = ahead + within;
        if (mine > 0 && run < target && target <= run + mine) {
            for (int j = a; j < b; j++) {
                run += kept_weight(w.r[j], w.inv_t, sh.mx, min_p);
                if (run >= target) {
                    out[row] = (u32)j;
                    break;
                }
            }
        }
        return;
    }
    if (threadIdx.x == 0) {
        sh.lo0 = rank_key(sh.mx, 0);
        sh.hi0 = rank_key(sh.lo_v, 0x7fffffff);
    }
    // The kept prefix: its last key, its tokens and their weight.
    u64 end_key = ~0ull, end_cnt = 0, end_mass = 0;
    if (!whole) {
        if (threadIdx.x == 0) sh.target = (u64)top_k;
        rank_search(w, sh, false, 0.f);
        end_key = sh.key;
        end_cnt = sh.cnt;
        end_mass = sh.mass;
    }
    if (top_p < 1.f) {
        if (!whole && threadIdx.x == 0) {
            u64 tp = (u64)ceil((double)top_p * (double)end_mass);
            sh.target = tp ? tp : 1;
        }
        rank_search(w, sh, true, whole ? top_p : 0.f);
        end_key = sh.key;
        end_cnt = sh.cnt;
        end_mass = sh.mass;
    }
    if (min_p > 0.f) {
        // Tokens at or above min-p × the best (e ≥ min_p) are a prefix of rank order: where
        // it is shorter, it ends the kept prefix.
        u64 last = 0, cnt = 0, mass = 0;
        for (int j = w.c0 + threadIdx.x; j < w.c1; j += blockDim.x) {
            float v = w.r[j];
            if (v != v) continue;
            float s = v * w.inv_t, e = rank_e(s, sh.mx);
            if (e < min_p) continue;
            u64 k = rank_key(s, j);
            last = k > last ? k : last;
            cnt++;
            mass += fixed_weight(e);
        }
        last = block_max_u64(last, sh.red);
        u64 chunk_cnt, chunk_mass, ahead;
        block_exclusive_scan(cnt, sh.red, &chunk_cnt);
        block_exclusive_scan(mass, sh.red, &chunk_mass);
        if (threadIdx.x == 0) {
            u64* mine = w.rs + SAMPLE_PART + 8 * w.part;
            mine[PART_MIN_P_LAST] = last;
            mine[PART_MIN_P_COUNT] = chunk_cnt;
            mine[PART_MIN_P_WEIGHT] = chunk_mass;
        }
        row_barrier(w, sh);
        const u64 all_cnt = row_total(w, sh, PART_MIN_P_COUNT, &ahead);
        const u64 all_mass = row_total(w, sh, PART_MIN_P_WEIGHT, &ahead);
        const u64 row_last = block_max_u64(part_word(w, PART_MIN_P_LAST), sh.red);
        if (row_last < end_key) {
            end_key = row_last;
            end_cnt = all_cnt;
            end_mass = all_mass;
        }
    }
    // The walk: the first key whose prefix weight reaches ⌊u × the kept weight⌋ + 1. A kept
    // prefix that fits the window is gathered whole when the window does not hold the target.
    __syncthreads();
    if (threadIdx.x == 0) sh.target = (u64)((double)u * (double)end_mass) + 1;
    __syncthreads();
    if (!window_holds(sh, true) && end_cnt <= SAMPLE_WINDOW) {
        if (threadIdx.x == 0) {
            sh.lo = sh.lo0;
            sh.hi = end_key;
            sh.before_cnt = 0;
            sh.before_mass = 0;
        }
        __syncthreads();
        rank_gather(w, sh);
    }
    rank_search(w, sh, true, 0.f);
    if (first_block) {
        u32 pick = (u32)(sh.key & 0xffffffffu);
        out[row] = pick < (u32)n ? pick : 0u;
    }
}
