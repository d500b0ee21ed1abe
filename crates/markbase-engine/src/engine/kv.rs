//! The KV block manager: which pool blocks each sequence holds, for the two layer kinds.
//!
//! Full-attention layers keep a block for every [`BLOCK_SIZE`] positions. Sliding-window layers
//! keep only the blocks their window still sees: once a block lies wholly before the window of
//! the sequence's next token it goes back to the pool, so a decoding sequence holds at most
//! `ceil(window / BLOCK_SIZE) + 1` of them (a prefill chunk of `n` tokens briefly needs the
//! blocks of `window − 1 + n` positions). KV-shared layers have no blocks of their own.
//!
//! Prefix caching: every completed block is registered in its pool under a key made of the
//! chain hash of all earlier blocks and its own tokens. A new sequence reuses the longest run of
//! cached blocks that leaves at least one token to run and whose sliding-window part is also
//! still cached (a hit at `H` tokens needs the sliding blocks of positions `H + 1 − window ..
//! H`; it falls back to a shorter `H` otherwise). Shared blocks are never written: a hit is a
//! whole number of blocks and new tokens go to new blocks.

use std::hash::{DefaultHasher, Hash, Hasher};

use markbase_models::NO_BLOCK;

use super::blocks::{BlockKey, BlockPool};

/// Token positions per KV block.
pub const BLOCK_SIZE: usize = 16;

/// Pool index of full-attention layers.
const FULL: usize = 0;
/// Pool index of sliding-window layers.
const SLIDING: usize = 1;

/// The KV blocks one sequence holds.
#[derive(Debug, Default)]
pub(crate) struct SeqKv {
    /// Tokens whose keys and values are in the cache.
    pub computed: usize,
    /// Full-attention block of each `BLOCK_SIZE` positions.
    pub full: Vec<u32>,
    /// Sliding-window block of each `BLOCK_SIZE` positions ([`NO_BLOCK`] once given back).
    pub sliding: Vec<u32>,
    /// Sliding table entries before this index are all [`NO_BLOCK`].
    released: usize,
    /// Chain hash through each completed block.
    hashes: Vec<u64>,
}

/// The two block pools and the rules for using them.
pub(crate) struct KvManager {
    pools: [BlockPool; 2],
    /// Whether the model has layers of each kind.
    has: [bool; 2],
    window: usize,
}

/// The chain hash after a block of `tokens` that follows chain hash `parent`.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl KvManager {
    /// Pools of `full` and `sliding` blocks (0 for a kind the model lacks) for a sliding window
    /// of `window` tokens.
    pub fn new(full: usize, sliding: usize, has: [bool; 2], window: usize) -> Self {
        KvManager {
            pools: [BlockPool::new(full), BlockPool::new(sliding)],
            has,
            window: window.max(1),
        }
    }

    /// Blocks in both pools.
    pub fn total(&self) -> usize {
        self.pools.iter().map(BlockPool::total).sum()
    }

    /// Blocks held by sequences in both pools.
    pub fn used(&self) -> usize {
        self.pools.iter().map(BlockPool::used).sum()
    }

    /// First position the window of a query at `pos` sees.
    fn window_start(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.window)
    }

    /// The key of block `i` of `tokens` after chain hash `parent`.
    fn key(parent: u64, tokens: &[u32], i: usize) -> BlockKey {
        BlockKey {
            parent,
            tokens: tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].into(),
        }
    }

    /// Starts an empty sequence that will run `tokens` from the longest usable cached prefix;
    /// returns the number of tokens found in the cache (their blocks are now shared).
    pub fn admit_cached(&mut self, kv: &mut SeqKv, tokens: &[u32]) -> usize {
        debug_assert!(kv.full.is_empty() && kv.sliding.is_empty() && kv.computed == 0);
        let most = tokens.len().saturating_sub(1) / BLOCK_SIZE;
        let mut keys = Vec::with_capacity(most);
        let mut hashes = Vec::with_capacity(most);
        let mut parent = 0u64;
        for i in 0..most {
            let key = Self::key(parent, tokens, i);
            let in_cache = |k: usize| !self.has[k] || self.pools[k].lookup(&key).is_some();
            if !in_cache(FULL) {
                break;
            }
            parent = chain(parent, &key.tokens);
            hashes.push(parent);
            keys.push(key);
        }
        // The longest hit whose sliding-window blocks are all still cached.
        let mut hit = keys.len();
        if self.has[SLIDING] {
            while hit > 0 {
                let lo = self.window_start(hit * BLOCK_SIZE) / BLOCK_SIZE;
                if (lo..hit).all(|i| self.pools[SLIDING].lookup(&keys[i]).is_some()) {
                    break;
                }
                hit -= 1;
            }
        }
        let lo = self.window_start(hit * BLOCK_SIZE) / BLOCK_SIZE;
        for (i, key) in keys[..hit].iter().enumerate() {
            if self.has[FULL] {
                let b = self.pools[FULL].lookup(key).expect("checked above");
                self.pools[FULL].share(b);
                kv.full.push(b);
            }
            if self.has[SLIDING] {
                if i < lo {
                    kv.sliding.push(NO_BLOCK);
                } else {
                    let b = self.pools[SLIDING].lookup(key).expect("checked above");
                    self.pools[SLIDING].share(b);
                    kv.sliding.push(b);
                }
            }
        }
        kv.released = if self.has[SLIDING] { lo.min(hit) } else { 0 };
        hashes.truncate(hit);
        kv.hashes = hashes;
        kv.computed = hit * BLOCK_SIZE;
        kv.computed
    }

    /// Makes sure the sequence has blocks for its next `n` tokens; `false` when a pool ran out
    /// (blocks taken so far stay with the sequence).
    pub fn reserve(&mut self, kv: &mut SeqKv, n: usize) -> bool {
        let need = (kv.computed + n).div_ceil(BLOCK_SIZE);
        if self.has[FULL] {
            while kv.full.len() < need {
                match self.pools[FULL].alloc() {
                    Some(b) => kv.full.push(b),
                    None => return false,
                }
            }
        }
        if self.has[SLIDING] {
            let lo = self.window_start(kv.computed) / BLOCK_SIZE;
            while kv.sliding.len() < need {
                if kv.sliding.len() < lo {
                    kv.sliding.push(NO_BLOCK);
                    continue;
                }
                match self.pools[SLIDING].alloc() {
                    Some(b) => kv.sliding.push(b),
                    None => return false,
                }
            }
        }
        true
    }

    /// Records that the sequence ran its next `n` tokens (`tokens` are all of its tokens):
    /// registers the blocks they completed and gives back sliding blocks out of the window.
    pub fn advance(&mut self, kv: &mut SeqKv, tokens: &[u32], n: usize) {
        kv.computed += n;
        for i in kv.hashes.len()..kv.computed / BLOCK_SIZE {
            let parent = kv.hashes.last().copied().unwrap_or(0);
            let key = Self::key(parent, tokens, i);
            kv.hashes.push(chain(parent, &key.tokens));
            if self.has[FULL] {
                self.pools[FULL].register(kv.full[i], key.clone());
            }
            if self.has[SLIDING] && kv.sliding[i] != NO_BLOCK {
                self.pools[SLIDING].register(kv.sliding[i], key);
            }
        }
        if self.has[SLIDING] {
            let lo = (self.window_start(kv.computed) / BLOCK_SIZE).min(kv.sliding.len());
            for b in &mut kv.sliding[kv.released..lo] {
                if *b != NO_BLOCK {
                    self.pools[SLIDING].release(*b);
                    *b = NO_BLOCK;
                }
            }
            kv.released = kv.released.max(lo);
        }
    }

    /// Gives back every block of the sequence and empties it.
    pub fn free(&mut self, kv: &mut SeqKv) {
        for &b in &kv.full {
            self.pools[FULL].release(b);
        }
        for &b in kv.sliding.iter().filter(|&&b| b != NO_BLOCK) {
            self.pools[SLIDING].release(b);
        }
        *kv = SeqKv::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    /// Runs `tokens` through `kv` in chunks of `chunk`, as the worker does.
    fn run(m: &mut KvManager, kv: &mut SeqKv, tokens: &[u32], chunk: usize) {
        while kv.computed < tokens.len() {
            let n = chunk.min(tokens.len() - kv.computed);
            assert!(m.reserve(kv, n));
            m.advance(kv, tokens, n);
        }
    }

    #[test]
    fn sliding_blocks_are_given_back_outside_the_window() {
        // Window 40: a decoding sequence holds at most ceil(40/16) + 1 = 4 sliding blocks.
        let mut m = KvManager::new(100, 100, [true, true], 40);
        let mut kv = SeqKv::default();
        let t = toks(200, 1);
        run(&mut m, &mut kv, &t[..20], 20);
        for end in 21..=200 {
            run(&mut m, &mut kv, &t[..end], 1);
            let held = kv.sliding.iter().filter(|&&b| b != NO_BLOCK).count();
            assert!(held <= 4, "{held} sliding blocks at {end} tokens");
            // Every block the next query sees is held.
            let lo = (end + 1).saturating_sub(40) / BLOCK_SIZE;
            assert!(kv.sliding[lo..].iter().all(|&b| b != NO_BLOCK));
        }
        assert_eq!(kv.full.len(), 13);
        m.free(&mut kv);
        assert_eq!(m.used(), 0);
    }

    #[test]
    fn prefix_hit_reuses_blocks_and_respects_the_window() {
        let mut m = KvManager::new(100, 100, [true, true], 40);
        let t = toks(100, 3);
        let mut a = SeqKv::default();
        run(&mut m, &mut a, &t, 7);
        // The first sequence still runs: its full blocks are shared, and a 96-token hit (6 of
        // the 6 blocks that leave a token to run) needs the sliding blocks of positions 57..95
        // (blocks 3..5), which it still holds; blocks 0..2 are not needed.
        let mut b = SeqKv::default();
        let hit = m.admit_cached(&mut b, &t);
        assert_eq!(hit, 96);
        assert_eq!(b.full, a.full[..6]);
        assert_eq!(&b.sliding[3..6], &a.sliding[3..6]);
        assert!(b.sliding[..3].iter().all(|&s| s == NO_BLOCK));
        // A prompt that differs inside block 2 hits only the first two blocks.
        let mut t2 = t.clone();
        t2[40] = 9999;
        let mut c = SeqKv::default();
        assert_eq!(m.admit_cached(&mut c, &t2), 32);
        // At least one token is always left to run.
        let mut d = SeqKv::default();
        assert_eq!(m.admit_cached(&mut d, &t[..32]), 16);
        for kv in [&mut a, &mut b, &mut c, &mut d] {
            m.free(kv);
        }
        assert_eq!(m.used(), 0);
    }

    #[test]
    fn evicted_sliding_blocks_shorten_the_hit() {
        // A sliding pool of 5 blocks: after another sequence reuses them, a hit must fall back
        // to a length whose window blocks are still cached (here: none but 0).
        let mut m = KvManager::new(100, 5, [true, true], 20);
        let t = toks(80, 5);
        let mut a = SeqKv::default();
        run(&mut m, &mut a, &t, 16);
        m.free(&mut a);
        let mut other = SeqKv::default();
        run(&mut m, &mut other, &toks(80, 6), 16);
        m.free(&mut other);
        let mut b = SeqKv::default();
        assert_eq!(m.admit_cached(&mut b, &t), 0);
        assert!(b.full.is_empty());
        // Without sliding layers the full blocks alone make the hit.
        let mut m = KvManager::new(100, 0, [true, false], 20);
        let mut a = SeqKv::default();
        run(&mut m, &mut a, &t, 16);
        m.free(&mut a);
        let mut b = SeqKv::default();
        assert_eq!(m.admit_cached(&mut b, &t), 64);
    }

    #[test]
    fn reserve_fails_when_the_pool_is_empty() {
        let mut m = KvManager::new(2, 2, [true, true], 8);
        let mut a = SeqKv::default();
        assert!(m.reserve(&mut a, 32));
        let mut b = SeqKv::default();
        assert!(!m.reserve(&mut b, 1));
        m.free(&mut a);
        assert!(m.reserve(&mut b, 1));
        assert_eq!(m.used(), 2);
        assert_eq!(m.total(), 4);
    }
}
